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

/* The update of one element; inlined into one loop per (Adam mode, copy-out kind) so each
 * loop has no branches left and vectorises. */
#define DS_ADAM_LOOP(ADAM_L2, STORE)                       \
    _Pragma("omp simd") for (int64_t i = 0; i < n; ++i) {  \
        float g = grad[i] * gs;                            \
        float w = p[i];                                    \
        if (ADAM_L2) g = g + w * l2;                       \
        w = w * decay;                                     \
        float mi = m[i] * b1;                              \
        mi = mi + g * omb1;                                \
        float vi = v[i] * b2;                              \
        vi = vi + (g * g) * omb2;                          \
        float d = sqrtf(vi) * ibc;                         \
        d = d + eps;                                       \
        w = w - (mi / d) * ss;                             \
        m[i] = mi;                                         \
        v[i] = vi;                                         \
        p[i] = w;                                          \
        STORE;                                             \
    }

#define DS_ADAM_MODES(STORE)         \
    if (adam_l2) {                   \
        DS_ADAM_LOOP(1, STORE)       \
    } else {                         \
        DS_ADAM_LOOP(0, STORE)       \
    }

DS_CLONES
static void adam_chunk(float *restrict p, const float *restrict grad, float *restrict m,
                       float *restrict v, int64_t n, const ds_adam_args *a, void *out16,
                       int out_kind, int64_t offset) {
    const float gs = a->grad_scale, l2 = a->l2, decay = a->decay, b1 = a->beta1,
                omb1 = a->omb1, b2 = a->beta2, omb2 = a->omb2, ibc = a->inv_bc2_sqrt,
                eps = a->eps, ss = a->step_size;
    const int adam_l2 = a->adam_l2;
    if (out_kind == OUT_BF16) {
        uint16_t *restrict o = (uint16_t *)out16 + offset;
        DS_ADAM_MODES(o[i] = bf16_rne(w))
    }
#if DS_HAVE_FP16
    else if (out_kind == OUT_FP16) {
        _Float16 *restrict h = (_Float16 *)out16 + offset;
        DS_ADAM_MODES(h[i] = (_Float16)w)
    }
#endif
    else {
        DS_ADAM_MODES((void)0)
    }
}

/* Chunks are cache-sized so each thread streams through its slice once. */
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
    const int64_t chunks = (n + DS_CHUNK - 1) / DS_CHUNK;
    (void)nthreads;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n >= DS_PARALLEL_MIN && nthreads > 1)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t lo = c * DS_CHUNK;
        const int64_t len = (n - lo) < DS_CHUNK ? (n - lo) : DS_CHUNK;
        adam_chunk(p + lo, grad + lo, m + lo, v + lo, len, &a, out16, out_kind, lo);
    }
    return 0;
}

/* The same memory traffic as one Adam step (read p, g, m, v; write p, m, v) with almost no
 * arithmetic: bench/cpu_adam.py measures the update's memory-bandwidth bound with it. */
DS_CLONES
static void touch_chunk(float *restrict p, const float *restrict g, float *restrict m,
                        float *restrict v, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const float gi = g[i];
        p[i] = p[i] + gi;
        m[i] = m[i] + gi;
        v[i] = v[i] + gi;
    }
}

void ds_cpu_adam_touch(float *p, const float *g, float *m, float *v, int64_t n, int nthreads) {
    const int64_t chunks = (n + DS_CHUNK - 1) / DS_CHUNK;
    (void)nthreads;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n >= DS_PARALLEL_MIN && nthreads > 1)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t lo = c * DS_CHUNK;
        const int64_t len = (n - lo) < DS_CHUNK ? (n - lo) : DS_CHUNK;
        touch_chunk(p + lo, g + lo, m + lo, v + lo, len);
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
