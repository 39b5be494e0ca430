/* What a copy from memory that is not in the CPU's cache to memory that is not either costs, by
 * kind of copy, on T threads at once (each its own 256 MiB): the fused copy's (`core::fused`:
 * 8-byte loads, MOVNTI stores, three CRC-32C chains), the same with 64-byte non-temporal stores
 * (the CRC still from the stored register, by extracts), each without its CRC, `memcpy`, and
 * `rep movsb` (what the kernel's copy to user memory uses, so what a `pread` from the page cache
 * costs at most). GB/s of all threads together, best of 5 passes.
 *
 *   gcc -O2 -pthread -o /tmp/copy_kinds benches/copy_kinds.c && /tmp/copy_kinds 1 && /tmp/copy_kinds 2
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define N (256u << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Three lanes, a third of the bytes each, their destinations kept apart in the 4 KiB cycle. */
#define THIRD(n) ((n) / 3 / 64 * 64)

__attribute__((target("sse4.2"))) static uint64_t fused8(uint8_t *d, const uint8_t *s, size_t n) {
    uint64_t r0 = 0, r1 = 0, r2 = 0;
    size_t t = THIRD(n);
    for (size_t i = 0; i < t; i += 8) {
        uint64_t a = *(const uint64_t *)(s + i), b = *(const uint64_t *)(s + t + i),
                 c = *(const uint64_t *)(s + 2 * t + i);
        _mm_stream_si64((long long *)(d + i), a);
        _mm_stream_si64((long long *)(d + t + 1024 + i), b);
        _mm_stream_si64((long long *)(d + 2 * t + 2048 + i), c);
        r0 = _mm_crc32_u64(r0, a);
        r1 = _mm_crc32_u64(r1, b);
        r2 = _mm_crc32_u64(r2, c);
    }
    _mm_sfence();
    return r0 ^ r1 ^ r2;
}

__attribute__((target("avx512f,avx512dq,sse4.2"))) static uint64_t crc_of(uint64_t r, __m512i v) {
    __m128i q[4] = {_mm512_extracti64x2_epi64(v, 0), _mm512_extracti64x2_epi64(v, 1),
                    _mm512_extracti64x2_epi64(v, 2), _mm512_extracti64x2_epi64(v, 3)};
    for (int k = 0; k < 4; k++) {
        r = _mm_crc32_u64(r, (uint64_t)_mm_cvtsi128_si64(q[k]));
        r = _mm_crc32_u64(r, (uint64_t)_mm_extract_epi64(q[k], 1));
    }
    return r;
}

__attribute__((target("avx512f,avx512dq,sse4.2"))) static uint64_t fused64(uint8_t *d, const uint8_t *s,
                                                                           size_t n) {
    uint64_t r0 = 0, r1 = 0, r2 = 0;
    size_t t = THIRD(n);
    for (size_t i = 0; i < t; i += 64) {
        __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + t + i),
                c = _mm512_loadu_si512(s + 2 * t + i);
        _mm512_stream_si512((void *)(d + i), a);
        _mm512_stream_si512((void *)(d + t + 1024 + i), b);
        _mm512_stream_si512((void *)(d + 2 * t + 2048 + i), c);
        r0 = crc_of(r0, a);
        r1 = crc_of(r1, b);
        r2 = crc_of(r2, c);
    }
    _mm_sfence();
    return r0 ^ r1 ^ r2;
}

__attribute__((target("sse4.2"))) static uint64_t movnti(uint8_t *d, const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i += 8)
        _mm_stream_si64((long long *)(d + i), *(const uint64_t *)(s + i));
    _mm_sfence();
    return 0;
}

__attribute__((target("avx512f"))) static uint64_t nt64(uint8_t *d, const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i += 64) _mm512_stream_si512((void *)(d + i), _mm512_loadu_si512(s + i));
    _mm_sfence();
    return 0;
}

static uint64_t libc_memcpy(uint8_t *d, const uint8_t *s, size_t n) {
    memcpy(d, s, n);
    return d[7];
}

static uint64_t rep_movsb(uint8_t *d, const uint8_t *s, size_t n) {
    __asm__ volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n)::"memory");
    return 0;
}

typedef uint64_t (*copy_fn)(uint8_t *, const uint8_t *, size_t);
static const struct {
    const char *name;
    copy_fn f;
} KINDS[] = {
    {"fused: movnti, CRC x3", fused8},  {"64-byte NT, CRC x3", fused64}, {"movnti alone", movnti},
    {"64-byte NT alone", nt64},         {"memcpy", libc_memcpy},         {"rep movsb", rep_movsb},
};
static int kind;

static void *one_thread(void *out) {
    uint8_t *s = aligned_alloc(4096, N + 8192), *d = aligned_alloc(4096, N + 8192);
    memset(s, 1, N + 8192);
    memset(d, 2, N + 8192);
    double best = 1e9;
    for (int r = 0; r < 5; r++) {
        double t = now();
        volatile uint64_t x = KINDS[kind].f(d + 64, s, N);
        (void)x;
        t = now() - t;
        best = t < best ? t : best;
    }
    *(double *)out = N / best / 1e9;
    free(s);
    free(d);
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    if (threads < 1 || threads > 16) threads = 1;
    for (kind = 0; kind < (int)(sizeof KINDS / sizeof KINDS[0]); kind++) {
        pthread_t p[16];
        double gbps[16], total = 0;
        for (int i = 0; i < threads; i++) pthread_create(&p[i], NULL, one_thread, &gbps[i]);
        for (int i = 0; i < threads; i++) {
            pthread_join(p[i], NULL);
            total += gbps[i];
        }
        printf("%-24s %d thread(s): %6.2f GB/s\n", KINDS[kind].name, threads, total);
    }
    return 0;
}
