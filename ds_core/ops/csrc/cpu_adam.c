/* cpu_adam: one Adam / AdamW step over fp32 parameters with fp32 state, SIMD + OpenMP.
 *
 * Bit-for-bit contract: each element goes through the same sequence of correctly rounded
 * fp32 operations as ds_core.ops.cpu_adam's pure-PyTorch path (one torch op per line below),
 * so the two paths give identical results. That is why this file is compiled with
 * -ffp-contract=off (no fused multiply-add) and never with -ffast-math; sqrt and divide are
 * IEEE correctly rounded in scalar and vector form alike.
 *
 *   g  = grad * grad_scale                    (unscale and clip in one multiplier)
 *   g  = g + p * l2                           (Adam mode only, when weight decay != 0)
 *   p  = p * decay                            (AdamW mode: decay = 1 - lr * weight_decay)
 *   m  = m * beta1 + g * (1 - beta1)
 *   v  = v * beta2 + (g * g) * (1 - beta2)
 *   d  = sqrt(v) * (1 / sqrt(bias_correction2)) + eps
 *   p  = p - (m / d) * (lr / bias_correction1)
 *   out16 = round_to_nearest_even(p)          (optional bf16 / fp16 copy for the device)
 *
 * SIMD: the chunk kernel is compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2) and the
 * baseline, and the dynamic loader picks the best one the CPU has at load time, so an
 * artefact built on one machine runs correctly on any other (no -march=native).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <emmintrin.h> /* SSE2 (every x86-64): the non-temporal 16-byte store */
#define DS_HAVE_STREAM 1
#else
#define DS_HAVE_STREAM 0
#endif

#if defined(__x86_64__) && !defined(DS_NO_CLONES) && \
    ((defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && __GNUC__ >= 12))
#define DS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define DS_HAVE_CLONES 1
#else
#define DS_CLONES
#define DS_HAVE_CLONES 0
#endif

#if defined(__FLT16_MAX__)
#define DS_HAVE_FP16 1
#else
#define DS_HAVE_FP16 0
#endif

enum { OUT_NONE = 0, OUT_BF16 = 1, OUT_FP16 = 2 };

typedef struct {
    float grad_scale, l2, decay, beta1, omb1, beta2, omb2, inv_bc2_sqrt, eps, step_size;
    int adam_l2;  /* 1: Adam with L2 weight decay folded into the gradient */
} ds_adam_args;

static inline uint16_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    /* NaN becomes the quiet NaN 0x7fc0, as torch converts it; written as a select so the
     * loop stays vectorised. */
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)r;
}

/* Memory layout of the loops (measured with bench/cpu_adam.py, figures in bench/README.md):
 *
 * - The arrays are walked in blocks of DS_BLOCK elements (four cache lines of each fp32
 *   stream). Each block first prefetches the block DS_PREFETCH elements ahead on the four
 *   fp32 streams: the hardware prefetcher alone left the update at 0.91x of a loop with the
 *   same traffic out of cache (the sqrt/divide chain keeps fewer loads in flight than the
 *   traffic loop does); with it the update runs at that loop's speed.
 * - With a 16-bit copy-out larger than DS_STREAM_MIN elements, the copy is written with
 *   non-temporal stores from a block-sized staging buffer in L1: the copy is not read again
 *   by this step, so a plain store's read-for-ownership of each line (2 more bytes per
 *   element) and the cache space it takes are saved. Below that size the copy may still be
 *   in cache when the caller reads it, so plain stores stay. */
#define DS_BLOCK 64
#define DS_PREFETCH 512
#ifndef DS_STREAM_MIN
#define DS_STREAM_MIN ((int64_t)1 << 22)
#endif

#define DS_PREFETCH_BLOCK(B0)                                          \
    if ((B0) + DS_PREFETCH + DS_BLOCK <= avail) {                      \
        for (int k = 0; k < DS_BLOCK; k += 16) {                       \
            __builtin_prefetch(p + (B0) + DS_PREFETCH + k, 1, 3);      \
            __builtin_prefetch(grad + (B0) + DS_PREFETCH + k, 0, 3);   \
            __builtin_prefetch(m + (B0) + DS_PREFETCH + k, 1, 3);      \
            __builtin_prefetch(v + (B0) + DS_PREFETCH + k, 1, 3);      \
        }                                                              \
    }

/* Writes one staged block of 16-bit values to dst (64-byte aligned) around the caches. */
static inline void stream_block(void *dst, const void *stage, int64_t count) {
#if DS_HAVE_STREAM
    if (count == DS_BLOCK) {
        for (int k = 0; k < DS_BLOCK * 2 / 16; ++k)
            _mm_stream_si128((__m128i *)dst + k, _mm_load_si128((const __m128i *)stage + k));
        return;
    }
#endif
    memcpy(dst, stage, (size_t)count * 2);
}

/* The update of one element; inlined into one loop per (Adam mode, copy-out kind) so each
 * loop has no branches left and vectorises. STORE writes the 16-bit copy (element i, block
 * start b0); FLUSH runs after each block. */
#define DS_ADAM_LOOP(ADAM_L2, STORE, FLUSH)                          \
    for (int64_t b0 = 0; b0 < n; b0 += DS_BLOCK) {                   \
        const int64_t be = n - b0 < DS_BLOCK ? n : b0 + DS_BLOCK;    \
        DS_PREFETCH_BLOCK(b0)                                        \
        _Pragma("omp simd") for (int64_t i = b0; i < be; ++i) {     \
            float g = grad[i] * gs;                                  \
            float w = p[i];                                          \
            if (ADAM_L2) g = g + w * l2;                             \
            w = w * decay;                                           \
            float mi = m[i] * b1;                                    \
            mi = mi + g * omb1;                                      \
            float vi = v[i] * b2;                                    \
            vi = vi + (g * g) * omb2;                                \
            float d = sqrtf(vi) * ibc;                               \
            d = d + eps;                                             \
            w = w - (mi / d) * ss;                                   \
            m[i] = mi;                                               \
            v[i] = vi;                                               \
            p[i] = w;                                                \
            STORE;                                                   \
        }                                                            \
        FLUSH;                                                       \
    }

#define DS_ADAM_MODES(STORE, FLUSH)         \
    if (adam_l2) {                          \
        DS_ADAM_LOOP(1, STORE, FLUSH)       \
    } else {                                \
        DS_ADAM_LOOP(0, STORE, FLUSH)       \
    }

/* n elements from p..; avail: elements valid from p on (prefetches stay inside the arrays);
 * out16 points at this range's first 16-bit element; stream: non-temporal copy-out, out16
 * 64-byte aligned. */
DS_CLONES
static void adam_range(float *restrict p, const float *restrict grad, float *restrict m,
                       float *restrict v, int64_t n, int64_t avail, const ds_adam_args *a,
                       void *out16, int out_kind, int stream) {
    const float gs = a->grad_scale, l2 = a->l2, decay = a->decay, b1 = a->beta1,
                omb1 = a->omb1, b2 = a->beta2, omb2 = a->omb2, ibc = a->inv_bc2_sqrt,
                eps = a->eps, ss = a->step_size;
    const int adam_l2 = a->adam_l2;
    if (out_kind == OUT_BF16) {
        uint16_t *restrict o = (uint16_t *)out16;
        if (stream) {
            _Alignas(64) uint16_t stage[DS_BLOCK];
            DS_ADAM_MODES(stage[i - b0] = bf16_rne(w), stream_block(o + b0, stage, be - b0))
        } else {
            DS_ADAM_MODES(o[i] = bf16_rne(w), (void)0)
        }
    }
#if DS_HAVE_FP16
    else if (out_kind == OUT_FP16) {
        _Float16 *restrict h = (_Float16 *)out16;
        if (stream) {
            _Alignas(64) _Float16 stage[DS_BLOCK];
            DS_ADAM_MODES(stage[i - b0] = (_Float16)w, stream_block(h + b0, stage, be - b0))
        } else {
            DS_ADAM_MODES(h[i] = (_Float16)w, (void)0)
        }
    }
#endif
    else {
        DS_ADAM_MODES((void)0, (void)0)
    }
}

/* One chunk: a plain-store head up to out16's first 64-byte boundary, then the rest with
 * non-temporal copy-out when `stream` is set. */
static void adam_chunk(float *p, const float *grad, float *m, float *v, int64_t n,
                       int64_t avail, const ds_adam_args *a, void *out16, int out_kind,
                       int stream) {
    if (!stream || !DS_HAVE_STREAM || ((uintptr_t)out16 & 1u)) {
        adam_range(p, grad, m, v, n, avail, a, out16, out_kind, 0);
        return;
    }
    int64_t head = (int64_t)(((uintptr_t)0 - (uintptr_t)out16) & 63u) / 2;
    if (head > n) head = n;
    adam_range(p, grad, m, v, head, avail, a, out16, out_kind, 0);
    adam_range(p + head, grad + head, m + head, v + head, n - head, avail - head, a,
               (uint16_t *)out16 + head, out_kind, 1);
#if DS_HAVE_STREAM
    _mm_sfence(); /* order the non-temporal stores before the caller reads the copy */
#endif
}

/* Chunks are cache-sized so each thread streams through its slice once; schedule(static)
 * gives each thread one contiguous run of chunks, so threads meet at one boundary. */
#define DS_CHUNK ((int64_t)1 << 14)
/* Below this, starting threads costs more than it saves. */
#define DS_PARALLEL_MIN ((int64_t)1 << 16)

/* Returns 0 on success, 1 when out_kind is not supported by this build. */
int ds_cpu_adam_step(float *p, const float *grad, float *m, float *v, int64_t n,
                     float grad_scale, float l2, float decay, float beta1, float omb1,
                     float beta2, float omb2, float inv_bc2_sqrt, float eps, float step_size,
                     int adam_l2, void *out16, int out_kind, int nthreads) {
    if (out_kind == OUT_FP16 && !DS_HAVE_FP16) return 1;
    if (out_kind != OUT_NONE && out_kind != OUT_BF16 && out_kind != OUT_FP16) return 1;
    const ds_adam_args a = {grad_scale, l2,           decay, beta1,     omb1,
                            beta2,      omb2,         inv_bc2_sqrt, eps, step_size,
                            adam_l2};
    const int stream = out_kind != OUT_NONE && n >= DS_STREAM_MIN;
    const int64_t chunks = (n + DS_CHUNK - 1) / DS_CHUNK;
    (void)nthreads;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n >= DS_PARALLEL_MIN && nthreads > 1)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t lo = c * DS_CHUNK;
        const int64_t len = (n - lo) < DS_CHUNK ? (n - lo) : DS_CHUNK;
        void *o = out_kind == OUT_NONE ? out16 : (void *)((uint16_t *)out16 + lo);
        adam_chunk(p + lo, grad + lo, m + lo, v + lo, len, n - lo, &a, o, out_kind, stream);
    }
    return 0;
}

/* The same memory traffic as one Adam step (read p, g, m, v; write p, m, v; with out16, write
 * a 16-bit copy of p the same way the step does) with almost no arithmetic:
 * bench/cpu_adam.py measures the update's memory-bandwidth bound with it. */
DS_CLONES
static void touch_range(float *restrict p, const float *restrict grad, float *restrict m,
                        float *restrict v, int64_t n, int64_t avail, uint16_t *restrict o,
                        int stream) {
    _Alignas(64) uint16_t stage[DS_BLOCK];
    for (int64_t b0 = 0; b0 < n; b0 += DS_BLOCK) {
        const int64_t be = n - b0 < DS_BLOCK ? n : b0 + DS_BLOCK;
        DS_PREFETCH_BLOCK(b0)
        if (o == NULL) {
#pragma omp simd
            for (int64_t i = b0; i < be; ++i) {
                const float gi = grad[i];
                p[i] = p[i] + gi;
                m[i] = m[i] + gi;
                v[i] = v[i] + gi;
            }
        } else if (stream) {
#pragma omp simd
            for (int64_t i = b0; i < be; ++i) {
                const float gi = grad[i], w = p[i] + gi;
                uint32_t u;
                memcpy(&u, &w, sizeof u);
                p[i] = w;
                m[i] = m[i] + gi;
                v[i] = v[i] + gi;
                stage[i - b0] = (uint16_t)(u >> 16);
            }
            stream_block(o + b0, stage, be - b0);
        } else {
#pragma omp simd
            for (int64_t i = b0; i < be; ++i) {
                const float gi = grad[i], w = p[i] + gi;
                uint32_t u;
                memcpy(&u, &w, sizeof u);
                p[i] = w;
                m[i] = m[i] + gi;
                v[i] = v[i] + gi;
                o[i] = (uint16_t)(u >> 16);
            }
        }
    }
}

void ds_cpu_adam_touch(float *p, const float *g, float *m, float *v, int64_t n, void *out16,
                       int nthreads) {
    const int stream = out16 != NULL && n >= DS_STREAM_MIN && DS_HAVE_STREAM &&
                       !((uintptr_t)out16 & 1u);
    const int64_t chunks = (n + DS_CHUNK - 1) / DS_CHUNK;
    (void)nthreads;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n >= DS_PARALLEL_MIN && nthreads > 1)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t lo = c * DS_CHUNK;
        const int64_t len = (n - lo) < DS_CHUNK ? (n - lo) : DS_CHUNK;
        uint16_t *o = out16 == NULL ? NULL : (uint16_t *)out16 + lo;
        if (!stream) {
            touch_range(p + lo, g + lo, m + lo, v + lo, len, n - lo, o, 0);
            continue;
        }
        int64_t head = (int64_t)(((uintptr_t)0 - (uintptr_t)o) & 63u) / 2;
        if (head > len) head = len;
        touch_range(p + lo, g + lo, m + lo, v + lo, head, n - lo, o, 0);
        touch_range(p + lo + head, g + lo + head, m + lo + head, v + lo + head, len - head,
                    n - lo - head, o + head, 1);
#if DS_HAVE_STREAM
        _mm_sfence();
#endif
    }
}

/* Which code this build runs on this CPU: the clone the loader picks, and OpenMP or not. */
const char *ds_cpu_adam_isa(void) {
#if DS_HAVE_CLONES
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4 (AVX-512)";
    if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3 (AVX2)";
    return "x86-64 baseline (SSE2)";
#else
    return "compiler default";
#endif
}

int ds_cpu_adam_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int ds_cpu_adam_has_fp16(void) { return DS_HAVE_FP16; }

/* From this many elements on, the 16-bit copy-out is written with non-temporal stores (never
 * where this build has no such store). */
int64_t ds_cpu_adam_stream_min(void) { return DS_HAVE_STREAM ? DS_STREAM_MIN : INT64_MAX; }
