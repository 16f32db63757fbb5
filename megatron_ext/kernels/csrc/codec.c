/* The fp32 CPU codecs: symmetric INT8/INT4 quantize and dequantize, the k-chunk dequantize-reduce, and ByteGrad's
 * min-max UINT8 k-row decode-and-average (k = 1: the dequantize).
 *
 * Why hand-written: Inductor generates the right loops for these, but on AVX2 its loads of integer vectors go
 * through ATen's vec256 partial-load path (a stack buffer filled with ones, a memcpy of the lanes, a 32-byte load
 * that cannot be store-forwarded), once per 8 elements: dequantize INT8 ran at a third of a float op's speed with
 * its output already in memory, and every op that reads codes or INT4 pair lanes missed half of the copy bandwidth
 * (AVX-512 builds use masked loads and are not affected). Here the loops are plain C that the compiler vectorises
 * for the build's CPU (-O3 -march=native), and one call costs microseconds where a compiled graph costs ~0.25 ms,
 * which matters at bucket sizes.
 *
 * Bits: what megatron_ext/kernels/reference.py computes, operation for operation in fp32, compiled with
 * -ffp-contract=off and without fast-math:
 *   absmax = the largest |x| of the group (compared as integers on the sign-cleared bits: orders non-negative floats,
 *   keeps a NaN); scale = absmax / qmax by IEEE division; codes = clamp(rint(x / safe), -qmax, qmax) with safe = 1
 *   for an all-zero group (the clamp is a no-op unless the scale is subnormal, where the reference clamps too);
 *   a partial last group is quantized as if zero-padded (the reference pads it); dequantize fl(code * scale); the
 *   reduce sums ((d_0 + d_1) + d_2) + ... in chunk order; min-max fl(fl(q + lb) / scale).
 * INT4 bytes hold elements (2j, 2j+1) in bits (4-7, 0-3). Inputs are finite (the reference's contract).
 *
 * Threads: every entry point splits its groups (or elements) into contiguous ranges, one per thread, in libgomp's
 * pool (the one torch has loaded); the caller picks the count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

static inline float abs_max(const float *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, 4);
        b &= 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    float f;
    memcpy(&f, &m, 4);
    return f;
}

static inline int32_t code_of(float v, float safe, float qm) {
    float r = rintf(v / safe);
    r = r < -qm ? -qm : (r > qm ? qm : r);
    return (int32_t)r;
}

/* the contiguous range [*a, *b) of n items for this thread */
static inline void my_range(int64_t n, int64_t *a, int64_t *b) {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    *a = n * t / nt;
    *b = n * (t + 1) / nt;
}

/* One group of g elements, n of them valid (n < g: the rest are zeros). */
static void quantize_group(const float *x, int64_t n, int64_t g, int bits, uint8_t *c, float *scale_out) {
    const float qm = bits == 8 ? 127.0f : 7.0f;
    const float scale = abs_max(x, n) / qm;
    const float safe = scale > 0.0f ? scale : 1.0f;
    *scale_out = scale;
    if (bits == 8) {
        int8_t *q = (int8_t *)c;
        for (int64_t i = 0; i < n; i++) q[i] = (int8_t)code_of(x[i], safe, qm);
        memset(q + n, 0, (size_t)(g - n));
        return;
    }
    const int64_t pairs = n / 2;
    for (int64_t j = 0; j < pairs; j++) {
        const int32_t e = code_of(x[2 * j], safe, qm), o = code_of(x[2 * j + 1], safe, qm);
        c[j] = (uint8_t)(((e & 15) << 4) | (o & 15));
    }
    int64_t j = pairs;
    if (n % 2) c[j++] = (uint8_t)((code_of(x[n - 1], safe, qm) & 15) << 4);
    memset(c + j, 0, (size_t)(g / 2 - j));
}

/* Quantize x[numel] zero-padded to groups * g elements (groups >= ceil(numel / g): qgZ's stage chunks can be
 * shorter than their slot, or empty) into codes [groups * g * bits / 8] and scales [groups]. */
void mx_quantize(const float *x, int64_t numel, int64_t groups, int64_t g, int bits, uint8_t *codes, float *scales,
                 int nthreads) {
    const int64_t bpg = g * bits / 8;
#pragma omp parallel num_threads(nthreads)
    {
        int64_t a, b;
        my_range(groups, &a, &b);
        for (int64_t i = a; i < b; i++) {
            const int64_t left = numel - i * g, n = left < 0 ? 0 : (left < g ? left : g);
            quantize_group(x + i * g, n, g, bits, codes + i * bpg, scales + i);
        }
    }
}

/* out[n] = fl(code * s) for the group's first n elements; sum: add to out (the reduce's later chunks). */
static inline void decode_group(const uint8_t *c, float s, int64_t n, int bits, int sum, float *out) {
    if (bits == 8) {
        const int8_t *q = (const int8_t *)c;
        if (sum)
            for (int64_t i = 0; i < n; i++) out[i] += (float)q[i] * s;
        else
            for (int64_t i = 0; i < n; i++) out[i] = (float)q[i] * s;
        return;
    }
    const int64_t pairs = n / 2;
    if (sum) {
        for (int64_t j = 0; j < pairs; j++) {
            const int8_t b = (int8_t)c[j];
            out[2 * j] += (float)(b >> 4) * s;
            out[2 * j + 1] += (float)((int8_t)(b << 4) >> 4) * s;
        }
    } else {
        for (int64_t j = 0; j < pairs; j++) {
            const int8_t b = (int8_t)c[j];
            out[2 * j] = (float)(b >> 4) * s;
            out[2 * j + 1] = (float)((int8_t)(b << 4) >> 4) * s;
        }
    }
    if (n % 2) {
        const float d = (float)((int8_t)c[pairs] >> 4) * s;
        out[n - 1] = sum ? out[n - 1] + d : d;
    }
}

/* The k chunks' sum (k = 1: the dequantization) of numel elements in groups of g, times factor (qgZ's averaging,
 * fused into its last decode while the group is in L1; 1: none): chunk i's codes start at codes + i * chunk_stride
 * and its scales at scales + i * scale_stride. */
void mx_dequantize_reduce(const uint8_t *codes, int64_t chunk_stride, const float *scales, int64_t scale_stride,
                          int k, int64_t numel, int64_t g, int bits, float factor, float *out, int nthreads) {
    const int64_t groups = (numel + g - 1) / g, bpg = g * bits / 8;
#pragma omp parallel num_threads(nthreads)
    {
        int64_t a, b;
        my_range(groups, &a, &b);
        for (int64_t i = a; i < b; i++) {
            const int64_t n = numel - i * g < g ? numel - i * g : g;
            float *o = out + i * g;
            for (int c = 0; c < k; c++)
                decode_group(codes + c * chunk_stride + i * bpg, scales[c * scale_stride + i], n, bits, c > 0, o);
            if (factor != 1.0f)
                for (int64_t j = 0; j < n; j++) o[j] = o[j] * factor;
        }
    }
}

/* ByteGrad's decode-and-average (k = 1, factor 1: the dequantization): out[i] = fl(fl(d_0[i] + d_1[i]) + ...) *
 * factor over k rows, d_a[i] =
 * fl(fl(q_a[i] + lb_a[c]) / scale_a[c]) for element i of chunk c; row a's codes start at q + a * q_stride, its
 * (scale, lb) at a * param_stride. Blocks of MX_MINMAX_BLOCK elements, within one chunk: one pass per row over a
 * block of out that stays in L1, each a plain loop the compiler vectorises. */
#define MX_MINMAX_BLOCK 2048
void mx_dequantize_minmax_reduce(const uint8_t *q, int64_t q_stride, const float *scale, const float *lb,
                                 int64_t param_stride, int k, int64_t numel, int64_t chunk, float factor, float *out,
                                 int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int64_t a, b;
        my_range(numel, &a, &b);
        while (a < b) {
            const int64_t c = a / chunk, chunk_end = (c + 1) * chunk < b ? (c + 1) * chunk : b;
            const int64_t stop = a + MX_MINMAX_BLOCK < chunk_end ? a + MX_MINMAX_BLOCK : chunk_end;
            float *o = out + a;
            const int64_t n = stop - a;
            {
                const uint8_t *src = q + a;
                const float l = lb[c], s = scale[c];
                for (int64_t i = 0; i < n; i++) o[i] = ((float)src[i] + l) / s;
            }
            for (int r = 1; r < k; r++) {
                const uint8_t *src = q + r * q_stride + a;
                const float l = lb[r * param_stride + c], s = scale[r * param_stride + c];
                for (int64_t i = 0; i < n; i++) o[i] = o[i] + ((float)src[i] + l) / s;
            }
            for (int64_t i = 0; i < n; i++) o[i] = o[i] * factor;
            a = stop;
        }
    }
}
