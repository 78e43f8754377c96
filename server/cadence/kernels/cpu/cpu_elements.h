// What every kernel source of the library shares: which vector paths this build has (from
// the -march its instruction set compiles with: CADENCE_AVX512_BF16, CADENCE_AVX2, else
// portable) and the conversions between the 16-bit element types and float32. Internal to
// each translation unit (an unnamed namespace): the library exports only its entry points.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CADENCE_AVX2 1
#endif

#if defined(CADENCE_AVX2) && defined(__AVX512BF16__) && defined(__AVX512F__)  // + AVX2 helpers
#include <immintrin.h>
#define CADENCE_AVX512_BF16 1
#endif

namespace {

// IEEE half precision: C++ compilers spell it _Float16 on x86-64 and __fp16 on aarch64
// (both convert to and from float with round to nearest even).
#if defined(__aarch64__)
using half_t = __fp16;
#else
using half_t = _Float16;
#endif

inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept NaN
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    // branch-free (a select), so loops over rows vectorize
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

#ifdef CADENCE_AVX2
// ---- 8 float32 lanes from float32, bfloat16 or float16 --------------------------------
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bfloat16
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
inline __m256 load8(const half_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif  // CADENCE_AVX2

#ifdef CADENCE_AVX512_BF16
// ---- 16 bfloat16 lanes at a time ------------------------------------------------------
// Same rounding as f32_to_bf16 (round to nearest even, NaN kept a quiet NaN), so a vector
// path gives the bits its scalar loop gives.
inline __m512 bf16x16_load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 bf16x16_round(__m512 x) {  // x rounded to bfloat16, kept as float32
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    __m512i r = _mm512_and_si512(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), high);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(
        r, nan, _mm512_and_si512(_mm512_or_si512(bits, _mm512_set1_epi32(0x400000)), high));
    return _mm512_castsi512_ps(r);
}

inline void bf16x16_store(uint16_t* p, __m512 rounded) {  // rounded: from bf16x16_round
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(rounded), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}
#endif  // CADENCE_AVX512_BF16

}  // namespace
