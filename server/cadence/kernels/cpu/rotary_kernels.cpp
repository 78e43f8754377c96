// The rotary embedding, in place (cadence_rotary) and on the way into the KV cache
// (cadence_rotary_write_kv: a step's queries rotated, its keys rotated and its values
// copied, or quantized, into their cache slots), rounding where torch's layer rounds.

#include "cache_rows.h"
#include "cpu_elements.h"
#include "cpu_kernels.h"
#include "fast_exp.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace cadence_kernels;  // DType, Status

#ifdef CADENCE_AVX512_BF16
// rotate_head's arithmetic for a bfloat16 head, head_dim % 32 == 0; dst may be src.
inline void rotate_head_bf16(const uint16_t* src, const uint16_t* c, const uint16_t* s,
                             uint16_t* dst, int head_dim) {
    const int half = head_dim / 2;
    for (int i = 0; i < half; i += 16) {
        const __m512 x1 = bf16x16_load(src + i), x2 = bf16x16_load(src + half + i);
        const __m512 c1 = bf16x16_load(c + i), c2 = bf16x16_load(c + half + i);
        const __m512 s1 = bf16x16_load(s + i), s2 = bf16x16_load(s + half + i);
        const __m512 lo = bf16x16_round(
            _mm512_add_ps(bf16x16_round(_mm512_mul_ps(x1, c1)),
                          bf16x16_round(_mm512_mul_ps(negate16(x2), s1))));
        const __m512 hi = bf16x16_round(_mm512_add_ps(bf16x16_round(_mm512_mul_ps(x2, c2)),
                                                      bf16x16_round(_mm512_mul_ps(x1, s2))));
        bf16x16_store(dst + i, lo);
        bf16x16_store(dst + half + i, hi);
    }
}
#endif

// Rotary embedding (the half-split "neox" layout) of one head read at x[at, at + head_dim):
// c/s are its token's cos/sin already rounded to the dtype, v scratch; o gets
// x' = round(round(x * cos) + round(rotate(x) * sin)) as float32.
template <int DT>
inline void rotate_head(const void* x, int64_t at, const float* c, const float* s, float* v,
                        float* o, int head_dim) {
    const int half = head_dim / 2;
    load_row<DT>(x, at, v, head_dim);
#pragma omp simd
    for (int i = 0; i < half; ++i)  // first half: x1 cos - x2 sin
        o[i] = round_to<DT>(round_to<DT>(v[i] * c[i]) + round_to<DT>(-v[i + half] * s[i]));
#pragma omp simd
    for (int i = half; i < head_dim; ++i)  // second half: x2 cos + x1 sin
        o[i] = round_to<DT>(round_to<DT>(v[i] * c[i]) + round_to<DT>(v[i - half] * s[i]));
}

// Whether the bfloat16 vector path takes a head of this size.
template <int DT>
constexpr bool rotary_vector(int head_dim) {
#ifdef CADENCE_AVX512_BF16
    return DT == BF16 && head_dim % 32 == 0;
#else
    (void)head_dim;
    return false;
#endif
}

// One token's heads [first, first + heads) of x (row `at`), rotated into dst (DST_T
// elements at dst_at, heads packed) -- which may be the same place.
template <int DT, int DST_T>
inline void rotate_heads(const void* x, int64_t at, int heads, int head_dim, const void* cos,
                         const void* sin, int64_t t, void* dst, int64_t dst_at, float* c,
                         float* s, float* v, float* o) {
#ifdef CADENCE_AVX512_BF16
    if constexpr (DT == BF16 && DST_T == BF16) {
        if (rotary_vector<DT>(head_dim)) {
            const auto* cs = static_cast<const uint16_t*>(cos) + t * head_dim;
            const auto* ss = static_cast<const uint16_t*>(sin) + t * head_dim;
            for (int h = 0; h < heads; ++h)
                rotate_head_bf16(static_cast<const uint16_t*>(x) + at + h * head_dim, cs, ss,
                                 static_cast<uint16_t*>(dst) + dst_at + h * head_dim, head_dim);
            return;
        }
    }
#endif
    load_row<DT>(cos, t * head_dim, c, head_dim);
    load_row<DT>(sin, t * head_dim, s, head_dim);
    for (int h = 0; h < heads; ++h) {
        rotate_head<DT>(x, at + static_cast<int64_t>(h) * head_dim, c, s, v, o, head_dim);
        store_row<DST_T>(dst, dst_at + static_cast<int64_t>(h) * head_dim, o, 1.0f, head_dim);
    }
}

// In place on x [T, heads, head_dim] with row stride x_stride (a view into the fused QKV
// output): cos/sin [T, head_dim] already rounded to the dtype.
template <int DT>
void rotary_all(void* x, int64_t tokens, int heads, int head_dim, int64_t x_stride,
                const void* cos, const void* sin, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> c(head_dim), s(head_dim), v(head_dim), o(head_dim);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; ++t)
            rotate_heads<DT, DT>(x, t * x_stride, heads, head_dim, cos, sin, t, x, t * x_stride,
                                 c.data(), s.data(), v.data(), o.data());
    }
}

// The attention layer's first half for T new tokens of a fused QKV output [T, x_stride]
// (heads q | kv_heads k | kv_heads v): the queries rotated into q_out [T, heads,
// head_dim], the keys rotated and the values copied into their cache slots (KT elements,
// cache rows [slot, kv_heads, head_dim]). Every token writes its own slot only.
template <int DT, int KT>
void rotary_write_kv_all(const void* qkv, int64_t tokens, int64_t x_stride, int heads,
                         int kv_heads, int head_dim, const void* cos, const void* sin,
                         void* q_out, void* k_cache, void* v_cache, float* k_scale,
                         float* v_scale, const int64_t* slots, int num_threads) {
    const int64_t kv_row = static_cast<int64_t>(kv_heads) * head_dim;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> c(head_dim), s(head_dim), v(head_dim), o(head_dim);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; ++t) {
            const int64_t row = t * x_stride, k_at = row + heads * head_dim;
            rotate_heads<DT, DT>(qkv, row, heads, head_dim, cos, sin, t, q_out,
                                 t * heads * head_dim, c.data(), s.data(), v.data(), o.data());
            if constexpr (quantized<KT>()) {  // each head rotated, then quantized
                load_row<DT>(cos, t * head_dim, c.data(), head_dim);
                load_row<DT>(sin, t * head_dim, s.data(), head_dim);
                for (int h = 0; h < kv_heads; ++h) {
                    rotate_head<DT>(qkv, k_at + h * head_dim, c.data(), s.data(), v.data(),
                                    o.data(), head_dim);
                    store_kv_row<KT>(k_cache, k_scale, slots[t] * kv_heads + h, o.data(), head_dim);
                    load_row<DT>(qkv, k_at + kv_row + h * head_dim, v.data(), head_dim);
                    store_kv_row<KT>(v_cache, v_scale, slots[t] * kv_heads + h, v.data(), head_dim);
                }
                continue;
            } else {
                rotate_heads<DT, KT>(qkv, k_at, kv_heads, head_dim, cos, sin, t, k_cache,
                                     slots[t] * kv_row, c.data(), s.data(), v.data(), o.data());
            }
            if constexpr (DT == KT) {
                std::memcpy(static_cast<char*>(v_cache) + slots[t] * kv_row * sizeof_dtype<KT>(),
                            static_cast<const char*>(qkv) + (k_at + kv_row) * sizeof_dtype<DT>(),
                            kv_row * sizeof_dtype<KT>());
            } else {
                for (int h = 0; h < kv_heads; ++h) {
                    load_row<DT>(qkv, k_at + kv_row + h * head_dim, v.data(), head_dim);
                    store_row<KT>(v_cache, slots[t] * kv_row + h * head_dim, v.data(), 1.0f, head_dim);
                }
            }
        }
    }
}

}  // namespace

extern "C" {

int cadence_rotary(void* x, int64_t tokens, int heads, int head_dim, int64_t x_stride,
                   const void* cos, const void* sin, int dtype, int num_threads) {
#define CALL(DT) rotary_all<DT>(x, tokens, heads, head_dim, x_stride, cos, sin, num_threads)
    CADENCE_BY_DTYPE(dtype, CALL)
#undef CALL
}

// qkv: [tokens, x_stride] of dtype (q heads | k heads | v heads per row); cos/sin:
// [tokens, head_dim] of dtype; q_out: [tokens, heads, head_dim] of dtype; caches of
// kv_dtype [slots, kv_heads, head_dim]; slots: [tokens] int64. See rotary_write_kv_all.
int cadence_rotary_write_kv(const void* qkv, int64_t tokens, int64_t x_stride, int heads,
                            int kv_heads, int head_dim, const void* cos, const void* sin,
                            void* q_out, void* k_cache, void* v_cache, float* k_scale,
                            float* v_scale, const int64_t* slots, int dtype, int kv_dtype,
                            int num_threads) {
#define CADENCE_WRITE(DT, KT)                                                              \
    if (dtype == DT && kv_dtype == KT) {                                                   \
        rotary_write_kv_all<DT, KT>(qkv, tokens, x_stride, heads, kv_heads, head_dim, cos, \
                                    sin, q_out, k_cache, v_cache, k_scale, v_scale, slots, \
                                    num_threads);                                          \
        return OK;                                                                         \
    }
    CADENCE_WRITE(F32, F32)
    CADENCE_WRITE(BF16, BF16)
    CADENCE_WRITE(F16, F16)
    CADENCE_WRITE(F32, BF16)
    CADENCE_WRITE(F32, F16)
    CADENCE_WRITE(BF16, F32)
    CADENCE_WRITE(F16, F32)
    CADENCE_WRITE(F32, I8)
    CADENCE_WRITE(BF16, I8)
    CADENCE_WRITE(F16, I8)
    CADENCE_WRITE(F32, F8E4M3)
    CADENCE_WRITE(BF16, F8E4M3)
    CADENCE_WRITE(F16, F8E4M3)
    CADENCE_WRITE(F32, F8E5M2)
    CADENCE_WRITE(BF16, F8E5M2)
    CADENCE_WRITE(F16, F8E5M2)
#undef CADENCE_WRITE
    return BAD_DTYPE;
}

}  // extern "C"
