/* overlapckpt's native helper: gather many small host values in one call.
 *
 * On CUDA, torch keeps Adam's (and AdamW's, ...) `step` counter of every parameter in
 * host memory, one 0-dim tensor each. A snapshot reads them all; from Python that is one
 * dispatch per tensor (0.2 to 2 us each), milliseconds inside optimizer.step() for a
 * Mixture-of-Experts rank's tens of thousands of parameters. Here it is a loop of memcpy.
 *
 * The caller (overlapckpt/train/copying/native.py) passes the values' addresses, checked
 * against the live tensors' data pointers in the same call's Python, and an output buffer
 * of count * itemsize bytes. Built with `cc -O2 -shared -fPIC`; no Python headers needed.
 * The Python twin (native.gather_values_python) does the same with one torch.stack.
 */
#include <stdint.h>
#include <string.h>

void overlapckpt_gather_values(const uint64_t *addresses, uint64_t count, uint64_t itemsize, unsigned char *out) {
    for (uint64_t k = 0; k < count; ++k) {
        memcpy(out + k * itemsize, (const void *)(uintptr_t)addresses[k], (size_t)itemsize);
    }
}
