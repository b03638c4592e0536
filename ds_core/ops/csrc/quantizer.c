/* Host kernels of the compressed collectives (ds_core/ops/quantizer.py): the 1-bit
 * compression of ds_core/comm/compressed.py and the block quantization of
 * ds_core/comm/quantized.py, each one pass (or two) over memory where the PyTorch twin makes
 * several temporaries.
 *
 * Block quantization computes in the same fp32 operations, in the same order, as the PyTorch
 * path (scale = absmax / qmax; inverse = qmax / absmax, 0 for an all-zero block; code =
 * round-half-even(x * inverse) clamped to [-qmax, qmax]; value = (code) * scale), and it is
 * built with -ffp-contract=off, so both paths give identical codes, scales and values. The
 * 1-bit scale sums squares in double; PyTorch's vector norm sums fp32 in another
 * order, so the two paths' scales differ by fp32 accumulation error (about 1e-5 relative
 * at a million elements; the kernel's is the more accurate). */

#include <math.h>
#include <stdint.h>

/* x (n floats, n a multiple of 8): scale = ||x|| / sqrt(n); bits[i/8] bit (7 - i%8) set where
 * x[i] is not negative (NaN counts as set); err[i] = x[i] - scale * (+-1). */
void ds_onebit_compress(const float *x, int64_t n, uint8_t *bits, float *err, float *scale) {
    /* four partial sums: independent chains the compiler can keep in flight */
    double sum[4] = {0.0, 0.0, 0.0, 0.0};
    for (int64_t i = 0; i < n; i += 4)
        for (int k = 0; k < 4; ++k) sum[k] += (double)x[i + k] * (double)x[i + k];
    const double total = (sum[0] + sum[1]) + (sum[2] + sum[3]);
    const float s = n > 0 ? (float)(sqrt(total) / sqrt((double)n)) : 0.0f;
    for (int64_t i = 0; i < n; ++i) err[i] = x[i] - (x[i] < 0.0f ? -s : s);
    for (int64_t byte = 0; byte < n / 8; ++byte) {
        const float *v = x + 8 * byte;
        bits[byte] = (uint8_t)(!(v[0] < 0.0f) << 7 | !(v[1] < 0.0f) << 6 | !(v[2] < 0.0f) << 5 |
                               !(v[3] < 0.0f) << 4 | !(v[4] < 0.0f) << 3 | !(v[5] < 0.0f) << 2 |
                               !(v[6] < 0.0f) << 1 | !(v[7] < 0.0f));
    }
    *scale = s;
}

/* rows of packed bits (world rows of chunk/8 bytes) with one weight per row:
 * out[j] = sum over rows r, in order, of (bit ? w[r] : -w[r]). */
void ds_onebit_weighted_sum(const uint8_t *bits, const float *w, int64_t world, int64_t chunk,
                            float *out) {
    const int64_t nbytes = chunk / 8;
    for (int64_t j = 0; j < chunk; ++j) out[j] = 0.0f;
    for (int64_t r = 0; r < world; ++r) {
        const uint8_t *row = bits + r * nbytes;
        const float pos = w[r], neg = -w[r];
        for (int64_t b = 0; b < nbytes; ++b) {
            const unsigned byte = row[b];
            float *o = out + 8 * b;
            for (int k = 0; k < 8; ++k) o[k] += (byte >> (7 - k)) & 1u ? pos : neg;
        }
    }
}

/* rows of packed bits, one scale per row: out[r * chunk + j] = bit ? scale[r] : -scale[r]. */
void ds_onebit_expand(const uint8_t *bits, const float *scale, int64_t world, int64_t chunk,
                      float *out) {
    const int64_t nbytes = chunk / 8;
    for (int64_t r = 0; r < world; ++r) {
        const uint8_t *row = bits + r * nbytes;
        const float pos = scale[r], neg = -scale[r];
        float *o = out + r * chunk;
        for (int64_t b = 0; b < nbytes; ++b) {
            const unsigned byte = row[b];
            for (int k = 0; k < 8; ++k) o[8 * b + k] = (byte >> (7 - k)) & 1u ? pos : neg;
        }
    }
}

/* rows x cols floats (row stride cols), blocks of `block` (cols padded with zeros to whole
 * blocks: `padded` per row, `block` even): codes (offset binary, one byte per value for 8
 * bits, two values per byte, first in the high nibble, for 4 bits) and one scale per block. */
void ds_quantize_blocks(const float *x, int64_t rows, int64_t cols, int64_t block, int64_t padded,
                        int bits, uint8_t *codes, float *scales) {
    const float qmax = (float)((1 << (bits - 1)) - 1);
    const int offset = 1 << (bits - 1);
    const int64_t nblocks = padded / block;
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * cols;
        for (int64_t b = 0; b < nblocks; ++b) {
            const int64_t lo = b * block;
            const int64_t hi = lo + block < cols ? lo + block : cols;
            float absmax = 0.0f;
            for (int64_t i = lo; i < hi; ++i) {
                const float a = fabsf(xr[i]);
                absmax = a > absmax ? a : absmax;
            }
            scales[r * nblocks + b] = absmax / qmax;
            const float inv = absmax > 0.0f ? qmax / absmax : 0.0f;
            for (int64_t i = lo; i < lo + block; i += 2) {
                float q0 = i < hi ? rintf(xr[i] * inv) : 0.0f;
                float q1 = i + 1 < hi ? rintf(xr[i + 1] * inv) : 0.0f;
                q0 = q0 > qmax ? qmax : (q0 < -qmax ? -qmax : q0);
                q1 = q1 > qmax ? qmax : (q1 < -qmax ? -qmax : q1);
                const int c0 = (int)q0 + offset, c1 = (int)q1 + offset;
                if (bits == 8) {
                    codes[r * padded + i] = (uint8_t)c0;
                    codes[r * padded + i + 1] = (uint8_t)c1;
                } else {
                    codes[(r * padded + i) / 2] = (uint8_t)(c0 << 4 | c1);
                }
            }
        }
    }
}

/* the inverse: out (rows x cols, row stride cols) = (code - offset) * scale of its block. */
void ds_dequantize_blocks(const uint8_t *codes, const float *scales, int64_t rows, int64_t cols,
                          int64_t block, int64_t padded, int bits, float *out) {
    const int offset = 1 << (bits - 1);
    const int64_t nblocks = padded / block;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < nblocks; ++b) {
            const float scale = scales[r * nblocks + b];
            const int64_t lo = b * block;
            const int64_t hi = lo + block < cols ? lo + block : cols;
            float *o = out + r * cols;
            if (bits == 8) {
                const uint8_t *c = codes + r * padded;
                for (int64_t i = lo; i < hi; ++i) o[i] = (float)((int)c[i] - offset) * scale;
            } else {
                const uint8_t *c = codes + (r * padded) / 2;
                for (int64_t i = lo; i < hi; ++i) {
                    const int code = i % 2 == 0 ? c[i / 2] >> 4 : c[i / 2] & 15;
                    o[i] = (float)(code - offset) * scale;
                }
            }
        }
    }
}
