/* hsx's native bf16 kernels: the byte-plane split of the bf16-split-zstd codec and its inverse (the
 * reader's join), and the Inf/NaN count of dump validation (which the split also makes).
 * storage/native.py builds and loads this file and calls it through ctypes, which releases the GIL for
 * the call; numpy does the same work where it is not built (bit-identical). Plain C99, no Python
 * headers: one library serves every Python. */
#include <stddef.h>
#include <stdint.h>

/* x86-64: one copy per instruction set, chosen at load time for the CPU the pod landed on. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HSX_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HSX_CLONES
#endif

/* Bumped when a signature changes: the loader refuses a library built from another version. */
uint32_t hsx_bf16_abi(void) { return 3; }

/* A bf16 value is Inf or NaN exactly when its 8 exponent bits are all ones. */
static inline uint16_t non_finite(uint16_t v) { return (uint16_t)((v & 0x7FFFu) >= 0x7F80u); }

/* Counts are kept per block small enough for a 16-bit lane to hold them, so the loops vectorise
 * without widening every compare. */
#define COUNT_BLOCK 0xFFFFu

/* high[i] = bits[i] >> 8, low[i] = bits[i] & 0xFF in one pass, no temporaries; returns the number of
 * Inf/NaN values, counted while the values are read anyway (dump validation without a second pass). */
HSX_CLONES
size_t hsx_bf16_split(const uint16_t *restrict bits, uint8_t *restrict high, uint8_t *restrict low, size_t n) {
    size_t total = 0;
    for (size_t start = 0; start < n; start += COUNT_BLOCK) {
        size_t end = n - start < COUNT_BLOCK ? n : start + COUNT_BLOCK;
        uint16_t count = 0;
        for (size_t i = start; i < end; i++) {
            uint16_t v = bits[i];
            high[i] = (uint8_t)(v >> 8);
            low[i] = (uint8_t)v;
            count += non_finite(v);
        }
        total += count;
    }
    return total;
}

/* bits[i] = high[i] << 8 | low[i]: the inverse of hsx_bf16_split, in one pass over the output. */
HSX_CLONES
void hsx_bf16_join(const uint8_t *restrict high, const uint8_t *restrict low, uint16_t *restrict bits, size_t n) {
    for (size_t i = 0; i < n; i++)
        bits[i] = (uint16_t)((uint16_t)high[i] << 8 | low[i]);
}

/* The number of Inf/NaN values. */
HSX_CLONES
size_t hsx_bf16_count_non_finite(const uint16_t *restrict bits, size_t n) {
    size_t total = 0;
    for (size_t start = 0; start < n; start += COUNT_BLOCK) {
        size_t end = n - start < COUNT_BLOCK ? n : start + COUNT_BLOCK;
        uint16_t count = 0;
        for (size_t i = start; i < end; i++)
            count += non_finite(bits[i]);
        total += count;
    }
    return total;
}
