/* overlapckpt's native helper: walk a pickle's opcodes before it is unpickled, keeping its memo's count.
 *
 * CPython's C unpickler sizes its memo by the largest index a PUT names, so a pickle from
 * storage is walked first (overlapckpt/format/pickle_bounds.py): each opcode's argument is
 * skipped by its length, PUTs must number the memo in order, GETs must name an entry
 * stored, and the data must end at a STOP. In Python that walk is one loop turn per opcode:
 * 0.9 s for the 8.8 MB .metadata of 30,000 tensors; here, milliseconds.
 *
 * The caller passes the argument kind of every opcode byte, built from pickletools' own
 * table (pickle_bounds._argument_kinds), so the two walks skip the same bytes. What the walk
 * finds goes back in `out`: the outcome, the byte it concerns, a memo index and the count
 * of entries stored; pickle_bounds.py turns it into the same refusal the Python walk words.
 * A text memo index (protocol 0) that is not plain digits goes back as WALK_TEXT_INDEX, and
 * the Python walk decides that pickle. Built with `cc -O2 -shared -fPIC`; no Python headers.
 */
#include <stdint.h>
#include <string.h>

enum { WALK_OK = 0, WALK_NO_STOP = 1, WALK_NO_OPCODE = 2, WALK_NO_NEWLINE = 3, WALK_BAD_LENGTH = 4,
       WALK_PAST_END = 5, WALK_PUT_OUT_OF_ORDER = 6, WALK_GET_UNSTORED = 7, WALK_TEXT_INDEX = 8 };
/* The argument kinds of pickle_bounds._argument_kinds: 0..8 a fixed length, else these. */
enum { KIND_NONE = -128, KIND_LINE = -1, KIND_LEN1 = -2, KIND_LEN4 = -3, KIND_LEN4U = -4, KIND_LEN8U = -5, KIND_TWO_LINES = -100 };
/* The memo's opcodes, fixed by the pickle protocol. */
enum { OP_PUT = 'p', OP_BINPUT = 'q', OP_LONG_BINPUT = 'r', OP_GET = 'g', OP_BINGET = 'h', OP_LONG_BINGET = 'j',
       OP_MEMOIZE = 0x94, OP_STOP = '.' };

static uint64_t little_endian(const uint8_t *p, int width) {
    uint64_t value = 0;
    for (int i = width - 1; i >= 0; --i) value = (value << 8) | p[i];
    return value;
}

static int text_index(const uint8_t *p, const uint8_t *newline, uint64_t *index) {
    /* Plain decimal digits before the newline, at most 18 of them; anything else: the Python walk decides. */
    if (p == newline || newline - p > 18) return 0;
    uint64_t value = 0;
    for (; p < newline; ++p) {
        if (*p < '0' || *p > '9') return 0;
        value = value * 10 + (uint64_t)(*p - '0');
    }
    *index = value;
    return 1;
}

/* out: [outcome, byte position, memo index, entries stored] */
void overlapckpt_pickle_walk(const uint8_t *data, uint64_t n, const int32_t *kinds, int64_t *out) {
    uint64_t pos = 0, stored = 0;
    for (;;) {
        if (pos >= n) { out[0] = WALK_NO_STOP; out[1] = (int64_t)n; return; }
        uint8_t code = data[pos];
        int32_t kind = kinds[code];
        if (kind == KIND_NONE) { out[0] = WALK_NO_OPCODE; out[1] = (int64_t)pos; out[2] = code; return; }
        uint64_t start = pos, argument = pos + 1;
        pos = argument;
        if (kind >= 0) {
            pos += (uint64_t)kind;
        } else if (kind == KIND_LINE || kind == KIND_TWO_LINES) {
            for (int line = 0; line < (kind == KIND_LINE ? 1 : 2); ++line) {
                const uint8_t *newline = pos < n ? memchr(data + pos, '\n', n - pos) : NULL;
                if (newline == NULL) { out[0] = WALK_NO_NEWLINE; out[1] = (int64_t)start; return; }
                pos = (uint64_t)(newline - data) + 1;
            }
        } else {
            int width = kind == KIND_LEN1 ? 1 : kind == KIND_LEN8U ? 8 : 4;
            if (pos + (uint64_t)width > n) { out[0] = WALK_PAST_END; out[1] = (int64_t)start; return; }
            uint64_t length = little_endian(data + pos, width);
            if (kind == KIND_LEN4 && length >= 0x80000000ULL) {  /* a negative length */
                out[0] = WALK_BAD_LENGTH; out[1] = (int64_t)start; out[2] = (int64_t)(int32_t)(uint32_t)length; return;
            }
            pos += (uint64_t)width;
            if (length > n - pos) { out[0] = WALK_PAST_END; out[1] = (int64_t)start; return; }
            argument = pos;
            pos += length;
        }
        if (pos > n) { out[0] = WALK_PAST_END; out[1] = (int64_t)start; return; }
        if (code == OP_MEMOIZE) {
            ++stored;
        } else if (code == OP_PUT || code == OP_BINPUT || code == OP_LONG_BINPUT || code == OP_GET || code == OP_BINGET || code == OP_LONG_BINGET) {
            uint64_t index;
            if (code == OP_PUT || code == OP_GET) {
                if (!text_index(data + argument, data + pos - 1, &index)) { out[0] = WALK_TEXT_INDEX; out[1] = (int64_t)start; return; }
            } else {
                index = little_endian(data + argument, (int)(pos - argument));
            }
            int put = code == OP_PUT || code == OP_BINPUT || code == OP_LONG_BINPUT;
            if (put && index > stored) {
                out[0] = WALK_PUT_OUT_OF_ORDER; out[1] = (int64_t)start; out[2] = (int64_t)index; out[3] = (int64_t)stored; return;
            }
            if (!put && index >= stored) {
                out[0] = WALK_GET_UNSTORED; out[1] = (int64_t)start; out[2] = (int64_t)index; out[3] = (int64_t)stored; return;
            }
            stored += put && index == stored;
        } else if (code == OP_STOP) {
            out[0] = WALK_OK; out[1] = (int64_t)pos; out[3] = (int64_t)stored; return;
        }
    }
}
