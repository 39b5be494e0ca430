/* How fast P processes, each wanting 1/P of every row of a row-major file in the page cache (a
 * Shard(0) -> Shard(1) load), can get their pieces, against reading 1/P of the file whole.
 *
 *   gcc -O2 -msse4.2 -o /tmp/piece_reads benches/piece_reads.c
 *   head -c 128M /dev/urandom > /tmp/dense.bin && cat /tmp/dense.bin > /dev/null
 *   for m in 0 1 2 3 4 5 6 7; do /tmp/piece_reads /tmp/dense.bin $m 4 2944; done
 *
 * Modes (each process, 5 passes, milliseconds per pass of the slowest process):
 *   0  roofline: its 1/P of the file, contiguous, by pread
 *   1  what olmo-chunks did before checks were delegated: every 256 KiB window by pread into one
 *      reused buffer, its pieces copied out of it
 *   2  the pieces copied straight out of a read-only mapping of the file
 *   3  as 1, with the CRC-32C of every window (the whole block must be read to check it)
 *   4  as 2, with the CRC-32C of its pieces only (what verifying by parts would compute)
 *   5  as 2, with the CRC-32C of every P-th window, read whole from the mapping (one rank checks
 *      each block for the host, the others trust it: `core::coop::delegate_checks`)
 *   6  what olmo-chunks does since: the windows this process checks (every P-th) by pread into
 *      one reused buffer, checked and its pieces copied out; the other windows' pieces copied
 *      straight out of a read-only mapping
 *   7  as 6, the checked windows checked and copied from the mapping too (no pread at all)
 * The CRC here is the serial SSE4.2 instruction, slower than the product's crc-fast.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <nmmintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static unsigned crc(unsigned c, const unsigned char *p, size_t n) {
    unsigned long long x = c;
    for (; n >= 8; p += 8, n -= 8) {
        unsigned long long w;
        memcpy(&w, p, 8);
        x = _mm_crc32_u64(x, w);
    }
    while (n--) x = _mm_crc32_u8((unsigned)x, *p++);
    return (unsigned)x;
}

static void pread_all(int fd, unsigned char *buf, size_t n, size_t off) {
    for (size_t done = 0; done < n;) {
        ssize_t k = pread(fd, buf + done, n - done, (off_t)(off + done));
        if (k <= 0) { perror("pread"); exit(1); }
        done += (size_t)k;
    }
}

static void one(int fd, size_t size, int mode, int p, int r, size_t row) {
    size_t rows = size / row, piece = row / p, share = size / p, W = 256 << 10;
    unsigned char *dst = malloc(rows * piece + share), *win = malloc(W);
    memset(dst, 0, rows * piece + share);
    unsigned c = 0;
    double t0 = now();
    for (int pass = 0; pass < 5; pass++) {
        if (mode == 0) {
            pread_all(fd, dst, share, r * share);
        } else if (mode == 1 || mode == 3) {
            for (size_t o = 0; o < size; o += W) {
                size_t n = size - o < W ? size - o : W;
                pread_all(fd, win, n, o);
                if (mode == 3) c = crc(c, win, n);
                for (size_t q = o / row; q * row < o + n; q++) {  /* the part of row q's piece here */
                    size_t lo = q * row + r * piece, hi = lo + piece;
                    if (lo < o) lo = o;
                    if (hi > o + n) hi = o + n;
                    if (lo < hi) memcpy(dst + q * piece + (lo - q * row - r * piece), win + (lo - o), hi - lo);
                }
            }
        } else if (mode == 6 || mode == 7) {
            unsigned char *m = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
            if (m == MAP_FAILED) { perror("mmap"); exit(1); }
            for (size_t o = 0; o < size; o += W) {
                size_t n = size - o < W ? size - o : W;
                const unsigned char *src = m + o;
                if ((o / W) % p == (size_t)r) {
                    if (mode == 6) { pread_all(fd, win, n, o); src = win; }
                    c = crc(c, src, n);
                }
                for (size_t q = o / row; q * row < o + n; q++) {
                    size_t lo = q * row + r * piece, hi = lo + piece;
                    if (lo < o) lo = o;
                    if (hi > o + n) hi = o + n;
                    if (lo < hi) memcpy(dst + q * piece + (lo - q * row - r * piece), src + (lo - o), hi - lo);
                }
            }
            munmap(m, size);
        } else {
            unsigned char *m = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
            if (m == MAP_FAILED) { perror("mmap"); exit(1); }
            for (size_t q = 0; q < rows; q++) {
                const unsigned char *sp = m + q * row + r * piece;
                memcpy(dst + q * piece, sp, piece);
                if (mode == 4) c = crc(c, sp, piece);
            }
            if (mode == 5)
                for (size_t o = (size_t)r * W; o < size; o += (size_t)p * W)
                    c = crc(c, m + o, size - o < W ? size - o : W);
            munmap(m, size);
        }
    }
    printf("process %d: %.1f ms per pass (crc %08x)\n", r, (now() - t0) / 5 * 1e3, c);
}

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: %s FILE MODE PROCESSES ROW_BYTES\n", argv[0]); return 2; }
    int fd = open(argv[1], O_RDONLY), mode = atoi(argv[2]), p = atoi(argv[3]);
    size_t row = (size_t)atol(argv[4]);
    if (fd < 0) { perror(argv[1]); return 1; }
    size_t size = (size_t)lseek(fd, 0, SEEK_END);
    for (int r = 0; r < p; r++)
        if (fork() == 0) { one(fd, size, mode, p, r, row); return 0; }
    while (wait(NULL) > 0) {}
    return 0;
}
