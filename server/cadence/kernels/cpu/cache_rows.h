// Rows of every element type the kernels read and write, to and from float32 scratch:
// sizes, the fp8 conversions, row loads and stores, a quantized KV cache's scales and its
// row writes, rounding to an activation dtype where torch rounds; and the dtype dispatch of
// the elementwise entry points. Internal to each translation unit (an unnamed namespace).

#pragma once

#include "cpu_elements.h"
#include "cpu_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using namespace cadence_kernels;  // DType, Status

template <int DT>
constexpr int64_t sizeof_dtype() {
    return DT == F32 ? 4 : (DT == BF16 || DT == F16) ? 2 : 1;
}

// The quantized KV cache's element types (cadence/kv_format.py): int8 with a scale per
// (slot, KV head), fp8 with one per layer.
template <int KT>
constexpr bool quantized() {
    return KT == I8 || KT == F8E4M3 || KT == F8E5M2;
}

// An fp8 element as IEEE half bits: e5m2 is half's top byte; e4m3's exponent and mantissa
// sit 7 bits up, where half reads them 2^8 too small (bias 15 against 7), subnormals
// included -- FP8_UNIT<F8E4M3> is that factor, applied with the scale.
inline uint16_t e4m3_half_bits(uint8_t b) {
    return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
}
inline uint16_t e5m2_half_bits(uint8_t b) { return static_cast<uint16_t>(b << 8); }

template <int KT>
constexpr float FP8_UNIT = KT == F8E4M3 ? 256.0f : 1.0f;

template <int KT>
inline float fp8_to_f32(uint8_t b) {
    const uint16_t bits = KT == F8E4M3 ? e4m3_half_bits(b) : e5m2_half_bits(b);
    half_t h;
    std::memcpy(&h, &bits, sizeof h);
    return static_cast<float>(h) * FP8_UNIT<KT>;
}

// float32 -> fp8 with E exponent bits (bias B) and M mantissa bits, rounded to nearest
// even, |x| at most the format's largest value (the caller clamps): what torch's
// conversion to float8_e4m3fn / float8_e5m2 gives.
template <int E, int M, int B>
inline uint8_t f32_to_fp8(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const uint32_t sign = (bits >> 24) & 0x80u, mag = bits & 0x7fffffffu;
    uint32_t code;
    if (mag < static_cast<uint32_t>(127 - B + 1) << 23) {  // below the smallest normal:
        // a multiple of the subnormal step 2^(1 - B - M), which as a code is that count
        float a;
        std::memcpy(&a, &mag, sizeof a);
        code = static_cast<uint32_t>(std::nearbyint(std::ldexp(a, B - 1 + M)));
    } else {
        const int drop = 23 - M;
        const uint32_t rounded = mag + ((1u << (drop - 1)) - 1) + ((mag >> drop) & 1u);
        code = ((rounded >> 23) - 127 + B) << M | ((rounded >> drop) & ((1u << M) - 1));
    }
    return static_cast<uint8_t>(sign | code);
}

template <int KT>
inline uint8_t f32_to_fp8_of(float x) {
    return KT == F8E4M3 ? f32_to_fp8<4, 3, 7>(x) : f32_to_fp8<5, 2, 15>(x);
}

// Row loads/stores between the cache's element type and float32 scratch (a quantized
// cache's elements as stored, before their scale).
template <int DT>
inline void load_row(const void* src, int64_t offset, float* dst, int n) {
    if constexpr (DT == I8) {
        const int8_t* s = static_cast<const int8_t*>(src) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
    } else if constexpr (DT == F8E4M3 || DT == F8E5M2) {
        const uint8_t* s = static_cast<const uint8_t*>(src) + offset;
        for (int i = 0; i < n; ++i) dst[i] = fp8_to_f32<DT>(s[i]);
    } else if constexpr (DT == F32) {
        const float* s = static_cast<const float*>(src) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) dst[i] = s[i];
    } else if constexpr (DT == BF16) {
        const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
    } else {
        const half_t* s = static_cast<const half_t*>(src) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
    }
}

template <int DT>
inline void store_row(void* dst, int64_t offset, const float* src, float mul, int n) {
    if constexpr (DT == F32) {
        float* d = static_cast<float*>(dst) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) d[i] = src[i] * mul;
    } else if constexpr (DT == BF16) {
        uint16_t* d = static_cast<uint16_t*>(dst) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i] * mul);
    } else {
        half_t* d = static_cast<half_t*>(dst) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) d[i] = static_cast<half_t>(src[i] * mul);
    }
}

// The scale of the cache row `row` (slot * kv_heads + head): int8's own, fp8's layer one,
// 1 for a float cache.
template <int KT>
inline float row_scale(const float* scales, int64_t row) {
    if constexpr (KT == I8) return scales[row];
    if constexpr (KT == F8E4M3 || KT == F8E5M2) return scales[0];
    return 1.0f;
}

// One KV head's n new elements x (float32, already rounded to the activations' dtype)
// into cache row `row` (slot * kv_heads + head) of a KT cache. int8: amax / 127 into
// scales[row], x * (127 / amax) rounded half to even; fp8: x * (1 / scales[0]), clamped
// to the format's range, rounded -- cadence/kv_format.py's arithmetic, for the same bits.
template <int KT>
inline void store_kv_row(void* cache, float* scales, int64_t row, const float* x, int n) {
    if constexpr (KT == I8) {
        float amax = 0.0f;
        for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t* d = static_cast<int8_t*>(cache) + row * n;
        for (int i = 0; i < n; ++i)
            d[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] * inv))));
        scales[row] = amax / 127.0f;
    } else if constexpr (KT == F8E4M3 || KT == F8E5M2) {
        const float top = KT == F8E4M3 ? 448.0f : 57344.0f;
        const float inv = 1.0f / scales[0];
        uint8_t* d = static_cast<uint8_t*>(cache) + row * n;
        for (int i = 0; i < n; ++i)
            d[i] = f32_to_fp8_of<KT>(std::min(top, std::max(-top, x[i] * inv)));
    } else {
        store_row<KT>(cache, row * n, x, 1.0f, n);
    }
}

// torch computes a bfloat16/float16 op in float32 and rounds its result to the tensor's
// dtype: the kernels round at the same points.
template <int DT>
inline float round_to(float x) {
    if constexpr (DT == F32) {
        return x;
    } else if constexpr (DT == BF16) {
        return bf16_to_f32(f32_to_bf16(x));
    } else {
        return static_cast<float>(static_cast<half_t>(x));
    }
}

template <int DT>
inline float load1(const void* p, int64_t i) {
    float f;
    load_row<DT>(p, i, &f, 1);
    return f;
}

template <int DT>
inline void store1(void* p, int64_t i, float f) {
    store_row<DT>(p, i, &f, 1.0f, 1);
}

}  // namespace

// An entry point's body for each activation dtype: `call(DT)` for F32, BF16 and F16.
#define CADENCE_BY_DTYPE(dtype, call)     \
    switch (dtype) {                      \
        case F32: call(F32); return OK;   \
        case BF16: call(BF16); return OK; \
        case F16: call(F16); return OK;   \
        default: return BAD_DTYPE;        \
    }
