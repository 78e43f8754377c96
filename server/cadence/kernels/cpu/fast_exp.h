// exp(x) in forms the compiler vectorizes (libm's expf is a scalar call), one polynomial
// for every width: fast_exp (scalar, vectorized by the compiler), exp8 (AVX2), exp16
// (AVX-512), each giving the same bits. The online softmax, SwiGLU and greedy sampling
// use them. Internal to each translation unit (an unnamed namespace).

#pragma once

#include "cpu_elements.h"

#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// 2^f for |f| <= 1/2: Taylor coefficients of degree 7 down to 0, shared by fast_exp and exp16.
constexpr int EXP2_POLY_TERMS = 8;
constexpr float EXP2_POLY[EXP2_POLY_TERMS] = {
    1.5252733804059838e-05f, 0.00015403530393381606f, 0.0013333558146428441f,
    0.009618129107628477f,   0.055504108664821576f,   0.2402265069591007f,
    0.6931471805599453f,     1.0f};

// a * b + c, rounded once where the build has FMA (as exp8's and exp16's _mm*_fmadd_ps),
// else twice: written out, so the bits never depend on whether the compiler fuses a
// multiply and an add where it inlines them (the kernels build with -ffp-contract=off).
inline float mul_add(float a, float b, float c) {
#ifdef __FMA__
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

// exp(x) in a form the compiler vectorizes (libm's expf is a scalar call): x = n ln2 +
// f ln2 with n an integer and |f| <= 1/2, 2^f by its Taylor series to degree 7 (relative
// error below 1e-8), 2^n by writing the exponent bits. Inputs below -87 give 0, so
// exp(-inf) is 0 as the online softmax needs.
inline float fast_exp(float x) {
    float y = x * 1.4426950408889634f;
    const bool underflow = !(y > -126.0f);  // also true for NaN-free -inf
    y = std::min(y, 126.0f);
    y = std::max(y, -126.0f);
    const float n = (y + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
    const float f = y - n;
    float p = EXP2_POLY[0];
#pragma GCC unroll 8  // unrolled, as before the loops around it are vectorized
    for (int i = 1; i < EXP2_POLY_TERMS; ++i) p = mul_add(p, f, EXP2_POLY[i]);
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return underflow ? 0.0f : p * scale;
}

#ifdef CADENCE_AVX2
// fast_exp on 8 lanes, in pieces: exp(x) = p * scale (scale = 2^n written into the
// exponent) in the lanes of `normal`, 0 in the others. The same operations as fast_exp,
// whose polynomial takes the same FMAs (mul_add): the same bits.
inline __m256 exp8_parts(__m256 x, __m256& scale, __m256& normal) {
    __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
    normal = _mm256_cmp_ps(y, _mm256_set1_ps(-126.0f), _CMP_GT_OQ);
    y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(126.0f));
    const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(y, n);
    __m256 p = _mm256_set1_ps(EXP2_POLY[0]);
    for (int i = 1; i < EXP2_POLY_TERMS; ++i)
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[i]));
    scale = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    return p;
}

inline __m256 exp8(__m256 x) {
    __m256 scale, normal;
    const __m256 p = exp8_parts(x, scale, normal);
    return _mm256_and_ps(normal, _mm256_mul_ps(p, scale));
}
#endif

#ifdef CADENCE_AVX512_BF16
// fast_exp on 16 lanes: the same polynomial, 2^n applied by vscalefps.
inline __m512 exp16(__m512 x) {
    __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __mmask16 normal = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
    y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(126.0f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
    for (int i = 1; i < EXP2_POLY_TERMS; ++i)
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[i]));
    return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

inline __m512 negate16(__m512 x) { return _mm512_xor_ps(x, _mm512_set1_ps(-0.0f)); }

// SwiGLU of 16 lanes of bfloat16 values (held as float32): round(round(silu(gate)) * up),
// rounded to bfloat16 as torch's layer rounds (silu_mul and the fused gate/up product alike).
inline __m512 silu_mul16(__m512 gate, __m512 up) {
    const __m512 e = exp16(negate16(gate));
    const __m512 silu = bf16x16_round(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    return bf16x16_round(_mm512_mul_ps(silu, up));
}
#endif

}  // namespace
