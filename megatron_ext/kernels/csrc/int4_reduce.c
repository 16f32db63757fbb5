/* The intra-node qgZ step for INT4 codes on CPU: dequantize k chunks, sum them in fp32, requantize.
 *
 * Why hand-written: Inductor's loop for this op is bound by its instruction mix (per 16 outputs and chunk: a
 * sign-extending load, shifts, an int-to-float conversion, a multiply, an add). Here a chunk's group has one scale,
 * so its 16 possible values fl(code * scale) go into one vector register, and decoding a nibble is one permute
 * (vpermps reads only an index's low 4 bits, so the low nibble needs no mask and the high one a shift): per 16
 * outputs and chunk a zero-extending load, a shift, a permute and an add. AVX2 (no 16-lane permute) decodes by
 * arithmetic instead (shifts, a conversion and the multiply that builds the table): same bits, half the width.
 *
 * Bits: what the reference computes, operation for operation in fp32 (see megatron_ext/kernels/reference.py): the
 * table holds fl(code * scale); sums run ((d_0 + d_1) + d_2) + ...; absmax is the largest |sum| (compared as
 * integers on the sign-cleared bits, which orders non-negative floats and keeps a NaN); scale = absmax / qmax by
 * IEEE division; codes = clamp(int32(rint(sum / scale)), -7, 7) with scale 1 for an all-zero group. Compiled
 * with -ffp-contract=off and without fast-math. Bytes keep the pair layout: input byte j of every chunk holds
 * elements (2j, 2j+1) in bits (4-7, 0-3), and so does output byte j, so nothing interleaves.
 *
 * Speed: the requantization of group g runs in the loop that sums group g+1 (run_groups), so the divider works
 * beside the permutes. The scalar loop serves a group's last (bytes mod MX_VEC_BYTES) bytes, and all bytes in a
 * build without AVX2 (the tests build one; megatron_ext uses Inductor's loop on such machines): the same math.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MX_AVX512 1
#define MX_AVX2 0
#define MX_VEC_BYTES 16   /* code bytes (32 elements) per vector step */
#elif defined(__AVX2__)
#include <immintrin.h>
#define MX_AVX512 0
#define MX_AVX2 1
#define MX_VEC_BYTES 8    /* code bytes (16 elements) per vector step */
#else
#define MX_AVX512 0
#define MX_AVX2 0
#define MX_VEC_BYTES 0
#endif

#ifndef MX_MAX_K
#error "MX_MAX_K (chunks one call reduces) comes from the build: megatron_ext/kernels/native.py passes -DMX_MAX_K"
#endif
#define QMAX 7

int mx_isa(void) { return MX_AVX512 ? 512 : (MX_AVX2 ? 256 : 0); }

static inline uint32_t abs_bits(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    return b & 0x7FFFFFFFu;
}

static inline int32_t to_code(float sum, float scale) {
    float r = rintf(sum / scale);
    /* int32 conversion as the vector instruction does it: NaN and out-of-range give INT32_MIN */
    int32_t q = (r != r || r >= 2147483648.0f || r < -2147483648.0f) ? INT32_MIN : (int32_t)r;
    return q < -QMAX ? -QMAX : (q > QMAX ? QMAX : q);
}

/* A group whose sums wait for their codes: they are written in the next group's loop (see run_groups). */
typedef struct {
    const float *even, *odd;
    float safe;   /* the divisor: the group's scale, or 1 for an all-zero group */
    int clamp;    /* whether a code can leave [-7, 7] (see code_scale) */
    uint8_t *dst;
} pending_t;

/* The group's scale and its pending codes from the largest |sum|'s bits. |sum| <= absmax and scale =
 * fl(absmax / 7) give |sum / scale| < 7.5 for a normal, finite scale: the clamp can only bite under a subnormal,
 * infinite or NaN scale. */
static pending_t code_scale(uint32_t maxbits, const float *even, const float *odd, uint8_t *dst, float *scale_out) {
    float absmax;
    memcpy(&absmax, &maxbits, 4);
    const float scale = absmax / (float)QMAX;
    *scale_out = scale;
    pending_t p = {even, odd, scale > 0.0f ? scale : 1.0f, !(scale >= FLT_MIN && scale <= FLT_MAX), dst};
    return p;
}

static void codes_tail(const pending_t *p, int64_t from, int64_t bpg) {
    for (int64_t j = from; j < bpg; j++)
        p->dst[j] = (uint8_t)(((to_code(p->even[j], p->safe) & 15) << 4) | (to_code(p->odd[j], p->safe) & 15));
}

#if MX_AVX512
/* 16 bytes of a pending group's codes (32 elements) */
static inline __attribute__((always_inline)) void codes_step(const pending_t *p, __m512 vs, int64_t j) {
    const __m512i lo = _mm512_set1_epi32(-QMAX), hi = _mm512_set1_epi32(QMAX), nib = _mm512_set1_epi32(15);
    /* rint and the int32 conversion in one instruction (nearest-even; NaN and overflow give INT32_MIN) */
    __m512i qe = _mm512_cvt_roundps_epi32(_mm512_div_ps(_mm512_load_ps(p->even + j), vs),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i qo = _mm512_cvt_roundps_epi32(_mm512_div_ps(_mm512_load_ps(p->odd + j), vs),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (p->clamp) {
        qe = _mm512_min_epi32(_mm512_max_epi32(qe, lo), hi);
        qo = _mm512_min_epi32(_mm512_max_epi32(qo, lo), hi);
    }
    /* the byte store keeps bits 0-7: (qe << 4) needs no mask */
    __m512i b = _mm512_or_si512(_mm512_slli_epi32(qe, 4), _mm512_and_si512(qo, nib));
    _mm_storeu_si128((__m128i *)(p->dst + j), _mm512_cvtepi32_epi8(b));
}

/* Over a group's first vec_bytes bytes: its sums into even/odd (returning the bits of the largest |sum|) and, in
 * the same loop, the codes of the previous group (prev, or NULL): the divider then works beside the permutes
 * instead of after them. Tables and pointers are copied into locals so that, with k a constant (see sums_vec),
 * they live in registers: the stores to even/odd may not alias them. */
static inline __attribute__((always_inline)) uint32_t sums_vec_k(const int k, const uint8_t *const *src_in,
                                                                 const float *scale, int64_t vec_bytes, float *even,
                                                                 float *odd, const pending_t *prev) {
    /* the code of nibble n, as fp32: n for n < 8, n - 16 above */
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    __m512 tv[MX_MAX_K];
    const uint8_t *src[MX_MAX_K];
    for (int i = 0; i < k; i++) {
        tv[i] = _mm512_mul_ps(codes, _mm512_set1_ps(scale[i])); /* fl(code * scale), as the scalar table */
        src[i] = src_in[i];
    }
    const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i vmax = _mm512_setzero_si512();
    const pending_t p = prev ? *prev : (pending_t){0};
    const __m512 vs = _mm512_set1_ps(p.safe);
    for (int64_t j = 0; j < vec_bytes; j += 16) {
        __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src[0] + j)));
        __m512 e = _mm512_permutexvar_ps(_mm512_srli_epi32(u, 4), tv[0]);
        __m512 o = _mm512_permutexvar_ps(u, tv[0]);
        for (int i = 1; i < k; i++) {
            u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src[i] + j)));
            e = _mm512_add_ps(e, _mm512_permutexvar_ps(_mm512_srli_epi32(u, 4), tv[i]));
            o = _mm512_add_ps(o, _mm512_permutexvar_ps(u, tv[i]));
        }
        _mm512_store_ps(even + j, e);
        _mm512_store_ps(odd + j, o);
        /* as integers (vrangeps would be one instruction, but drops a quiet NaN) */
        vmax = _mm512_max_epu32(vmax, _mm512_and_si512(_mm512_castps_si512(e), mask));
        vmax = _mm512_max_epu32(vmax, _mm512_and_si512(_mm512_castps_si512(o), mask));
        if (prev) codes_step(&p, vs, j);
    }
    return _mm512_reduce_max_epu32(vmax);
}

#endif

#if MX_AVX2
/* AVX2 has no 16-lane permute: a table lookup would take two permutes and a blend, and the lane-crossing permutes
 * bound the loop (11.1 ms for 64M elements, k = 4, one thread, on an AMD EPYC 7xx3). So a nibble is decoded by
 * arithmetic instead: the sign-extended byte shifted, converted to fp32 and multiplied by the chunk's scale, which
 * is exactly the table's fl(code * scale): 7.6 ms. */
/* 8 bytes of a pending group's codes (16 elements) */
static inline __attribute__((always_inline)) void codes_step(const pending_t *p, __m256 vs, int64_t j) {
    const __m256i lo = _mm256_set1_epi32(-QMAX), hi = _mm256_set1_epi32(QMAX), nib = _mm256_set1_epi32(15);
    const __m256i byte0 = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                           0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    /* rint (nearest-even, whatever MXCSR says), then a truncating conversion of the integral value: NaN and
     * overflow give INT32_MIN, as to_code */
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i qe = _mm256_cvttps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_load_ps(p->even + j), vs), rnd));
    __m256i qo = _mm256_cvttps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_load_ps(p->odd + j), vs), rnd));
    if (p->clamp) {
        qe = _mm256_min_epi32(_mm256_max_epi32(qe, lo), hi);
        qo = _mm256_min_epi32(_mm256_max_epi32(qo, lo), hi);
    }
    /* byte 0 of every lane, gathered per 128-bit half, then the halves' 4 bytes side by side */
    __m256i b = _mm256_shuffle_epi8(_mm256_or_si256(_mm256_slli_epi32(qe, 4), _mm256_and_si256(qo, nib)), byte0);
    __m128i out = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storel_epi64((__m128i *)(p->dst + j), out);
}

/* As the AVX-512 sums_vec_k (same loop structure and bits), 8 code bytes per step. */
static inline __attribute__((always_inline)) uint32_t sums_vec_k(const int k, const uint8_t *const *src_in,
                                                                 const float *scale, int64_t vec_bytes, float *even,
                                                                 float *odd, const pending_t *prev) {
    __m256 sv[MX_MAX_K];
    const uint8_t *src[MX_MAX_K];
    for (int i = 0; i < k; i++) {
        sv[i] = _mm256_set1_ps(scale[i]);
        src[i] = src_in[i];
    }
    const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i vmax = _mm256_setzero_si256();
    const pending_t p = prev ? *prev : (pending_t){0};
    const __m256 vs = _mm256_set1_ps(p.safe);
    for (int64_t j = 0; j < vec_bytes; j += 8) {
        /* b: 8 bytes sign-extended; the high nibble's code is b >> 4, the low one's (b << 28) >> 28 */
        __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src[0] + j)));
        __m256 e = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(b, 4)), sv[0]);
        __m256 o = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 28), 28)), sv[0]);
        for (int i = 1; i < k; i++) {
            b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src[i] + j)));
            e = _mm256_add_ps(e, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(b, 4)), sv[i]));
            o = _mm256_add_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 28), 28)),
                                               sv[i]));
        }
        _mm256_store_ps(even + j, e);
        _mm256_store_ps(odd + j, o);
        vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_castps_si256(e), mask));
        vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_castps_si256(o), mask));
        if (prev) codes_step(&p, vs, j);
    }
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(vmax), _mm256_extracti128_si256(vmax, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return (uint32_t)_mm_cvtsi128_si32(m);
}
#endif

#if MX_AVX512 || MX_AVX2
/* sums_vec_k with k a compile-time constant for the usual ranks per node (unrolled), else a loop over k */
static uint32_t sums_vec(int k, const uint8_t *const *src, const float *scale, int64_t vec_bytes, float *even,
                         float *odd, const pending_t *prev) {
    switch (k) {
#define MX_CASE(K) \
    case K: return prev ? sums_vec_k(K, src, scale, vec_bytes, even, odd, prev) \
                        : sums_vec_k(K, src, scale, vec_bytes, even, odd, NULL);
    MX_CASE(1) MX_CASE(2) MX_CASE(3) MX_CASE(4) MX_CASE(5) MX_CASE(6) MX_CASE(7) MX_CASE(8)
#undef MX_CASE
    default: return sums_vec_k(k, src, scale, vec_bytes, even, odd, prev);
    }
}

/* the codes of a group's first vec_bytes bytes, alone (the last group of a worker) */
static void codes_vec(const pending_t *p, int64_t vec_bytes) {
#if MX_AVX512
    const __m512 vs = _mm512_set1_ps(p->safe);
#else
    const __m256 vs = _mm256_set1_ps(p->safe);
#endif
    for (int64_t j = 0; j < vec_bytes; j += MX_VEC_BYTES) codes_step(p, vs, j);
}
#endif

typedef struct {
    const uint8_t *chunks;
    int64_t chunk_stride;   /* bytes between chunks */
    const float *scales;
    int64_t scale_stride;   /* floats between chunks' scales */
    int k;
    int64_t bpg;            /* bytes per group */
    uint8_t *codes;
    float *out_scales;
    int64_t g0, g1;         /* this worker's groups */
    int status;
} job_t;

/* Groups [g0, g1): group g's sums (pass 1) run in one loop with group g-1's codes (pass 2), sums alternating
 * between two L1-sized buffers; the last group's codes follow alone. */
static void run_groups(job_t *job) {
    const int k = job->k;
    const int64_t bpg = job->bpg, padded = (bpg + 15) / 16 * 16;
    float *buf = (float *)aligned_alloc(64, (size_t)padded * 4 * sizeof(float));
    if (!buf) {
        job->status = -1;
        return;
    }
    float table[MX_MAX_K][16];
    const int64_t vec_bytes = MX_VEC_BYTES ? bpg / MX_VEC_BYTES * MX_VEC_BYTES : 0;
    pending_t pending;
    int has_pending = 0;
    for (int64_t g = job->g0; g < job->g1; g++) {
        float *even = buf + (g % 2) * 2 * padded, *odd = even + padded;
        const uint8_t *src[MX_MAX_K];
        float scale_in[MX_MAX_K];
        for (int i = 0; i < k; i++) {
            scale_in[i] = job->scales[i * job->scale_stride + g];
            src[i] = job->chunks + i * job->chunk_stride + g * bpg;
        }
        uint32_t maxbits = 0;
#if MX_AVX512 || MX_AVX2
        maxbits = sums_vec(k, src, scale_in, vec_bytes, even, odd, has_pending ? &pending : NULL);
#endif
        if (has_pending) codes_tail(&pending, vec_bytes, bpg);
        if (vec_bytes < bpg)
            for (int i = 0; i < k; i++)
                for (int n = 0; n < 16; n++) table[i][n] = (float)(n < 8 ? n : n - 16) * scale_in[i];
        for (int64_t j = vec_bytes; j < bpg; j++) {
            float e = table[0][src[0][j] >> 4], o = table[0][src[0][j] & 15];
            for (int i = 1; i < k; i++) {
                e = e + table[i][src[i][j] >> 4];
                o = o + table[i][src[i][j] & 15];
            }
            even[j] = e;
            odd[j] = o;
            uint32_t be = abs_bits(e), bo = abs_bits(o);
            maxbits = be > maxbits ? be : maxbits;
            maxbits = bo > maxbits ? bo : maxbits;
        }
        pending = code_scale(maxbits, even, odd, job->codes + g * bpg, job->out_scales + g);
        has_pending = 1;
    }
    if (has_pending) {
#if MX_AVX512 || MX_AVX2
        codes_vec(&pending, vec_bytes);
#endif
        codes_tail(&pending, vec_bytes, bpg);
    }
    free(buf);
}

/* codes[groups * bpg], out_scales[groups] of the sum of the k chunks; 0 on success, -1 on a failed allocation,
 * -2 on bad arguments. Up to nthreads OpenMP threads, each on a contiguous range of groups: torch's own OpenMP
 * runtime (the library is linked against libgomp.so.1, which torch has loaded), so its idle workers are the ones
 * that run this instead of spinning beside it. */
int mx_int4_reduce_quantize(const uint8_t *chunks, int64_t chunk_stride, const float *scales, int64_t scale_stride,
                            int k, int64_t groups, int64_t bpg, uint8_t *codes, float *out_scales, int nthreads) {
    if (k < 1 || k > MX_MAX_K || groups < 0 || bpg < 1) return -2;
    if (nthreads > groups) nthreads = (int)groups;
    if (nthreads < 1) nthreads = 1;
    int status = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static, 1) reduction(min : status)
    for (int t = 0; t < nthreads; t++) {
        job_t job = {chunks, chunk_stride, scales, scale_stride, k, bpg, codes, out_scales,
                     groups * t / nthreads, groups * (t + 1) / nthreads, 0};
        run_groups(&job);
        status = job.status < status ? job.status : status;
    }
    return status;
}
