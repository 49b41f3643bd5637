/* The shm allreduce's inner loop in C (shm_kernel.py compiles and loads it; shm.py says the
 * protocol). Python pays 2-5 us per ATen call and per flag poll, and a round of a 4 KB piece at
 * 8 ranks made ~12 of them (a copy in, a store, a futex wake, the spin, k - 1 adds): this does a
 * whole round in one call, with the GIL released, and a reduce-scatter's k - 1 adds in one.
 *
 * - Sums keep shm.py's order and bits: out = p0 + p1, then out += p2, ... in rank order, each an
 *   IEEE add in the element's type (float32 or float64), as torch.add and add_ do. Vectorising
 *   across elements changes no element's order; no -ffast-math, no contraction (adds only).
 * - Flags are int64 stores and loads on x86-64 (TSO: a store is seen after the stores before it).
 *   A publish is a sequentially consistent store (a full fence), then a read of the peers'
 *   sleep marks: a waiter writes its mark before it sleeps, and the kernel reads the flag under
 *   a lock (a full fence too), so either the waiter sees the new value and does not sleep, or
 *   the publisher sees the mark and wakes it (Dekker's pairing). Nobody asleep: no syscall.
 * - A wait spins at most `spin_ns`; past it the caller (Python) sleeps on the futex with its
 *   liveness and timeout checks, so nothing here can hang.
 */
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>
#include <limits.h>

#define LINE_WORDS 8  /* int64 words per rank's flag line (64 bytes) */
#define MARK 2        /* word of a rank's own line: 1 + the flag word index it sleeps on, 0 awake */
#define TAGS 3        /* words TAGS + 2 * parity, + 1: the tag code and key of a small round of that half */

enum { F32 = 0, F64 = 1 };

/* What a segment's rounds need, filled once by shm_kernel.py (field order matters). */
typedef struct {
    int64_t *flags;       /* the k flag lines */
    char *slots[2];       /* each half's rank-0 input slot; rank r's is at + r * slot_stride */
    int64_t slot_stride;  /* bytes from one rank's input slot to the next */
    int64_t spin_ns;      /* how long a wait spins before it returns to sleep in Python */
    int32_t k;
    int32_t rank;
} phx_group;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* out[i] = rows[0][i] + rows[1][i] + ... + rows[k-1][i], added in row order; row r starts
 * r * stride bytes after `first`. `out` overlaps no row (restrict: the loops vectorise). */
#define SUM_ROWS(T)                                                                               \
    do {                                                                                          \
        T *restrict o = (T *)out;                                                                 \
        const T *restrict a = (const T *)first, *restrict b = (const T *)(first + stride);      \
        for (int64_t i = 0; i < n; i++) o[i] = a[i] + b[i];                                       \
        for (int32_t r = 2; r < k; r++) {                                                         \
            const T *restrict p = (const T *)(first + r * stride);                               \
            for (int64_t i = 0; i < n; i++) o[i] += p[i];                                         \
        }                                                                                         \
    } while (0)

/* One build serves any x86-64: the loader picks the widest vectors this CPU has (an ifunc). */
__attribute__((target_clones("avx2", "avx", "default")))
void phx_sum_rows(void *out, const char *first, int64_t stride, int32_t k, int64_t n, int32_t dtype) {
    if (dtype == F32)
        SUM_ROWS(float);
    else
        SUM_ROWS(double);
}

/* out[i] = row 0 + row 1 + ... + row k-1, added in row order, where row `own` is `out` itself (a
 * reduce-scatter's own part, never copied into its slot) and row r != own starts r * stride bytes
 * after `first`. The partial sums wait in a block on the stack, so `out`'s own values are read
 * before they are overwritten; the adds are the same as phx_sum_rows', in the same order. */
#define SUM_OWN_BLOCK 512
#define SUM_OWN(T)                                                                                \
    do {                                                                                          \
        T *o = (T *)out;                                                                          \
        T acc[SUM_OWN_BLOCK];                                                                     \
        for (int64_t lo = 0; lo < n; lo += SUM_OWN_BLOCK) {                                       \
            int64_t m = n - lo < SUM_OWN_BLOCK ? n - lo : SUM_OWN_BLOCK;                          \
            { /* only reads of the rows in here (restrict); `out` is written after it */          \
                const T *restrict a = (own == 0 ? o : (const T *)first) + lo;                     \
                const T *restrict b = (own == 1 ? o : (const T *)(first + stride)) + lo;          \
                for (int64_t i = 0; i < m; i++) acc[i] = a[i] + b[i];                             \
                for (int32_t r = 2; r < k; r++) {                                                 \
                    const T *restrict p = (r == own ? o : (const T *)(first + r * stride)) + lo;  \
                    for (int64_t i = 0; i < m; i++) acc[i] += p[i];                               \
                }                                                                                 \
            }                                                                                     \
            memcpy(o + lo, acc, (size_t)m * sizeof(T));                                           \
        }                                                                                         \
    } while (0)

__attribute__((target_clones("avx2", "avx", "default")))
void phx_sum_own(void *out, const char *first, int64_t stride, int32_t k, int32_t own, int64_t n, int32_t dtype) {
    if (dtype == F32)
        SUM_OWN(float);
    else
        SUM_OWN(double);
}

/* The NaN/Inf check's notes (data_parallel/guards/finite.py), taken in the pass that moves the data
 * anyway: `*note` += the sum of what is copied or summed, added in LANES independent partial sums of
 * the element's type (so the loop vectorises without reordering any one of them), then combined in
 * double. Only whether a note is finite is read: it is NaN/Inf when an element is, or when finite
 * elements sum past the type's range, as torch.sum's. The copied and summed values are unchanged. */
#define LANES 32
#define NOTED(T, VALUE_AT, STORE)                                                                 \
    do {                                                                                          \
        T acc[LANES] = {0};                                                                       \
        int64_t i = 0;                                                                            \
        for (; i + LANES <= n; i += LANES)                                                        \
            for (int32_t j = 0; j < LANES; j++) { T v = VALUE_AT(i + j); STORE(i + j, v); acc[j] += v; } \
        double s = 0;                                                                             \
        for (; i < n; i++) { T v = VALUE_AT(i); STORE(i, v); s += v; }                           \
        for (int32_t j = 0; j < LANES; j++) s += acc[j];                                          \
        *note += s;                                                                               \
    } while (0)

#define COPY_AT(i) src[i]
#define COPY_STORE(i, v) dst[i] = v
#define COPY_NOTED(T)                                                                             \
    do {                                                                                          \
        T *restrict dst = (T *)out;                                                               \
        const T *restrict src = (const T *)in;                                                    \
        NOTED(T, COPY_AT, COPY_STORE);                                                            \
    } while (0)

/* out = in (n elements), and *note += their sum. */
__attribute__((target_clones("avx2", "avx", "default")))
void phx_copy_noted(void *out, const void *in, int64_t n, int32_t dtype, double *note) {
    if (dtype == F32)
        COPY_NOTED(float);
    else
        COPY_NOTED(double);
}

#define FIRST_AT(i) (a[i] + p[i])
#define LAST_AT(i) (o[i] + p[i])
#define LAST_STORE(i, v) o[i] = v
#define SUM_ROWS_NOTED(T)                                                                         \
    do {                                                                                          \
        T *restrict o = (T *)out;                                                                 \
        const T *restrict a = (const T *)first, *restrict p = (const T *)(first + stride);      \
        if (k > 2) { /* rows 0..k-2 as phx_sum_rows adds them, then the last one noted */          \
            phx_sum_rows(out, first, stride, k - 1, n, dtype);                                    \
            p = (const T *)(first + (int64_t)(k - 1) * stride);                                  \
            NOTED(T, LAST_AT, LAST_STORE);                                                        \
        } else {                                                                                  \
            NOTED(T, FIRST_AT, LAST_STORE);                                                       \
        }                                                                                         \
    } while (0)

/* phx_sum_rows, the same adds in the same order, and *note += the sum of `out` as it ends. */
__attribute__((target_clones("avx2", "avx", "default")))
void phx_sum_rows_noted(void *out, const char *first, int64_t stride, int32_t k, int64_t n, int32_t dtype,
                        double *note) {
    if (dtype == F32)
        SUM_ROWS_NOTED(float);
    else
        SUM_ROWS_NOTED(double);
}

/* Set this rank's `field` to `value`; wake the peers that sleep on it (only those that marked). */
void phx_publish(const phx_group *g, int32_t field, int64_t value) {
    int64_t index = (int64_t)g->rank * LINE_WORDS + field;
    int64_t *word = &g->flags[index];
    __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
    for (int32_t r = 0; r < g->k; r++) {
        if (r != g->rank && __atomic_load_n(&g->flags[(int64_t)r * LINE_WORDS + MARK], __ATOMIC_SEQ_CST) == index + 1) {
            syscall(SYS_futex, (void *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);  /* wakes every sleeper */
            return;
        }
    }
}

/* 1 once every peer's `field` is >= value, 0 if `spin_ns` passed first. */
int32_t phx_spin(const phx_group *g, int32_t field, int64_t value) {
    int64_t deadline = -1;
    for (int32_t r = 0; r < g->k; r++) {
        const int64_t *word = &g->flags[(int64_t)r * LINE_WORDS + field];
        while (__atomic_load_n(word, __ATOMIC_ACQUIRE) < value) {
            int64_t t = now_ns();
            if (deadline < 0) deadline = t + g->spin_ns;
            if (t >= deadline) return 0;
            __builtin_ia32_pause();
        }
    }
    return 1;
}

/* 1 if every rank's tag words of half `parity` hold `code` and `key` (read after every rank
 * arrived in the round: a peer rewrites them only two rounds on, after this rank arrives in the next). */
int32_t phx_tags_agree(const phx_group *g, int32_t parity, int64_t code, int64_t key) {
    for (int32_t r = 0; r < g->k; r++) {
        const int64_t *words = &g->flags[(int64_t)r * LINE_WORDS + TAGS + 2 * parity];
        if (__atomic_load_n(&words[0], __ATOMIC_ACQUIRE) != code || __atomic_load_n(&words[1], __ATOMIC_ACQUIRE) != key)
            return 0;
    }
    return 1;
}

/* This rank's call in half `parity` carries `code` and `key`: stored before the round's arrival
 * is published, whose sequentially consistent store orders them before it. */
static void write_tags(const phx_group *g, int32_t parity, int64_t code, int64_t key) {
    int64_t *tags = &g->flags[(int64_t)g->rank * LINE_WORDS + TAGS + 2 * parity];
    __atomic_store_n(&tags[0], code, __ATOMIC_RELAXED);
    __atomic_store_n(&tags[1], key, __ATOMIC_RELAXED);
}

/* One round of a piece summed whole by every rank (shm.py's small pieces): copy in, write this
 * call's tag code and key beside the flags, publish arrival, spin, sum every slot in rank order
 * into the piece, compare every rank's tag. `notes`: NULL, or the check's two notes, added to (the
 * own piece's sum, the summed piece's). 1: done, every rank's call carried the same tag; 2: done, a
 * tag differs (the caller asks the collective board whether that is a mismatch); 0: a peer is late,
 * the caller sleeps until all arrived, then calls phx_sum_rows (or _noted) and phx_tags_agree itself. */
int32_t phx_small_round(const phx_group *g, int32_t parity, int64_t round, void *piece, int64_t numel,
                        int32_t dtype, int64_t code, int64_t key, double *notes) {
    int64_t nbytes = numel * (dtype == F32 ? 4 : 8);
    char *slot = g->slots[parity] + (int64_t)g->rank * g->slot_stride;
    if (notes)  /* notes[0] += this rank's own piece's sum, notes[1] += the summed piece's */
        phx_copy_noted(slot, piece, numel, dtype, &notes[0]);
    else
        memcpy(slot, piece, (size_t)nbytes);
    write_tags(g, parity, code, key);
    phx_publish(g, 0, round);
    if (!phx_spin(g, 0, round)) return 0;
    if (notes)
        phx_sum_rows_noted(piece, g->slots[parity], g->slot_stride, g->k, numel, dtype, &notes[1]);
    else
        phx_sum_rows(piece, g->slots[parity], g->slot_stride, g->k, numel, dtype);
    return phx_tags_agree(g, parity, code, key) ? 1 : 2;
}

/* One round of a reduce-scatter (shm_ops.py): copy the window [start, stop) of `flat` but this
 * rank's part [lo, hi) into its slot, write the call's tag, publish arrival, spin, then sum its
 * part from every slot, its own values read in place, and compare every rank's tag. 1: done,
 * the tags agree; 2: done, a tag differs; 0: a peer is late, the caller sleeps until all
 * arrived, then calls phx_sum_own and phx_tags_agree itself. An empty part (hi <= lo) copies the
 * whole window. */
int32_t phx_reduce_scatter_round(const phx_group *g, int32_t parity, int64_t round, void *flat, int64_t start,
                                 int64_t lo, int64_t hi, int64_t stop, int32_t dtype, int64_t code, int64_t key) {
    int64_t size = dtype == F32 ? 4 : 8;
    char *slot = g->slots[parity] + (int64_t)g->rank * g->slot_stride, *data = (char *)flat;
    if (hi > lo) {
        memcpy(slot, data + start * size, (size_t)((lo - start) * size));
        memcpy(slot + (hi - start) * size, data + hi * size, (size_t)((stop - hi) * size));
    } else {
        memcpy(slot, data + start * size, (size_t)((stop - start) * size));
    }
    write_tags(g, parity, code, key);
    phx_publish(g, 0, round);
    if (!phx_spin(g, 0, round)) return 0;
    if (hi > lo)
        phx_sum_own(data + lo * size, g->slots[parity] + (lo - start) * size, g->slot_stride, g->k, g->rank, hi - lo,
                    dtype);
    return phx_tags_agree(g, parity, code, key) ? 1 : 2;
}

/* The window [start, stop) of `flat` but this rank's part [lo, hi), copied out of half `parity`'s
 * result area (an all-gather round's second half; the whole window for an empty part). */
void phx_gather_out(const phx_group *g, int32_t parity, void *flat, int64_t start, int64_t lo, int64_t hi,
                    int64_t stop, int64_t size) {
    const char *result = g->slots[parity] + (int64_t)g->k * g->slot_stride;
    char *data = (char *)flat;
    if (hi > lo) {
        memcpy(data + start * size, result, (size_t)((lo - start) * size));
        memcpy(data + hi * size, result + (hi - start) * size, (size_t)((stop - hi) * size));
    } else {
        memcpy(data + start * size, result, (size_t)((stop - start) * size));
    }
}

/* One round of an all-gather (shm_ops.py): copy this rank's part [lo, hi) of `flat` into its place
 * in half `parity`'s result area (the k + 1-th slot, which every rank fills a part of), write the
 * call's tag, publish arrival, spin, copy the rest of the window out, compare every rank's tag.
 * Bytes of `size` each: a copy, whatever the dtype. Returns as phx_reduce_scatter_round; when a
 * peer is late the caller sleeps, then calls phx_gather_out and phx_tags_agree itself. */
int32_t phx_all_gather_round(const phx_group *g, int32_t parity, int64_t round, void *flat, int64_t start,
                             int64_t lo, int64_t hi, int64_t stop, int64_t size, int64_t code, int64_t key) {
    char *result = g->slots[parity] + (int64_t)g->k * g->slot_stride;
    if (hi > lo)
        memcpy(result + (lo - start) * size, (char *)flat + lo * size, (size_t)((hi - lo) * size));
    write_tags(g, parity, code, key);
    phx_publish(g, 0, round);
    if (!phx_spin(g, 0, round)) return 0;
    phx_gather_out(g, parity, flat, start, lo, hi, stop, size);
    return phx_tags_agree(g, parity, code, key) ? 1 : 2;
}
