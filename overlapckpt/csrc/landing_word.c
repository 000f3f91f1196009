/* overlapckpt's landing words: stores with release and loads with acquire, across two processes.
 *
 * A pipelined snapshot (overlapckpt/landing_page.py) is written by the writer process while
 * the training process still copies it into their shared host slot. The trainer publishes
 * how many bytes of the slot hold the snapshot; the writer reads an entry only once that
 * count covers it. The count's store must not become visible before the copy's own stores
 * (release), and the writer's reads of the entry must not be served before its load of the
 * count (acquire). x86-64 orders plain stores and loads so already; ARM (a Grace host) does
 * not, hence these two functions. Built with `cc -O2 -shared -fPIC`; no Python headers.
 */
#include <stdint.h>

void overlapckpt_store_release(int64_t *word, int64_t value) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

void overlapckpt_load_acquire(const int64_t *word, int64_t *out) {
    *out = __atomic_load_n(word, __ATOMIC_ACQUIRE);
}
