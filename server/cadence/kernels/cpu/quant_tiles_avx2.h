// The AVX2 tiles of quant_kernels.cpp (the avx2 build, x86-64-v3: no VNNI): up to
// TILE_ROWS rows x TILE_BLOCKS blocks of 16 output channels, each block two 8-lane halves.
// The 4-column dot product vpdpbusd gives per 32-bit lane is built from vpmaddubsw
// (unsigned x signed bytes, adjacent pairs summed to int16) and vpmaddwd by ones (the two
// int16 of a lane summed to int32). The same packed layouts as the VNNI tiles.

#pragma once

#include "cpu_elements.h"  // bf16_to_f32, load8
#include "cpu_kernels.h"
#include "quant_rows.h"

#include <immintrin.h>

#include <cstring>

namespace cadence_quant {

using cadence_kernels::QUANT_INT4;
using cadence_kernels::QUANT_INT8;

constexpr int HALVES = 2;  // 8-lane halves of a 16-channel block
constexpr int64_t HALF_BYTES = 32;

// quantize_block_portable's block in four vectors, bit for bit: the same amax, the same
// products rounded to nearest even (vcvtps2dq under the default rounding, as nearbyint),
// an exact integer sum; a block reaching past k is read through a zero-padded copy, as the
// portable path zeroes it. The scalar loop took 4% of a prompt's prefill on a Zen 3.
#define CADENCE_QUANT_VECTOR_QUANTIZE 1

inline BlockQuantized quantize_block_vector(const void* x, int64_t base, int64_t col0,
                                            int64_t k, int dtype, int8_t* q) {
    if (col0 + BLOCK > k) {
        float padded[BLOCK] = {};
        for (int64_t i = 0; col0 + i < k; ++i)
            padded[i] = dtype == cadence_kernels::BF16
                            ? bf16_to_f32(
                                  static_cast<const uint16_t*>(x)[base + col0 + i])
                            : static_cast<const float*>(x)[base + col0 + i];
        return quantize_block_vector(padded, 0, 0, BLOCK, cadence_kernels::F32, q);
    }
    __m256 v[4];
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 amax8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        const int64_t at = base + col0 + 8 * i;
        v[i] = dtype == cadence_kernels::BF16 ? load8(static_cast<const uint16_t*>(x) + at)
                                              : load8(static_cast<const float*>(x) + at);
        amax8 = _mm256_max_ps(_mm256_and_ps(v[i], abs_mask), amax8);  // NaN: ignored, as std::max
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const __m256 scale = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
    // packs interleave 128-bit lanes: dwords come out as 0a 1a 2a 3a 0b 1b 2b 3b
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                             _mm256_packs_epi32(qi[2], qi[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    return {amax / 127.0f, _mm_cvtsi128_si32(s4)};
}

inline __m256i broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// int16 pair sums of a lane -> its int32 sum.
inline __m256i widen_pairs(__m256i pairs) {
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// int4: weights 0..15 and activations -127..127 make a vpmaddubsw pair at most
// 2 * 15 * 127 = 3810, so the 8 of a 32-column block (4 low-nibble, 4 high-nibble) sum to
// at most 30480 in int16: one vpmaddwd per block and half. Then the block's scales:
// acc += (sum * d) * scale + zero' * d * sum(q).
template <int ROWS, int NV>
void int4_tile(const uint8_t* w, const float* sz, int64_t k32, const TileRows<ROWS>& x,
               const Prefetch& next, float* out, int64_t out_stride) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[ROWS][NV][HALVES];
    set_all(acc, _mm256_setzero_ps());
    for (int64_t b = 0; b < k32; ++b) {
        next.block(b);
        __m256i pairs[ROWS][NV][HALVES];
        set_all(pairs, _mm256_setzero_si256());
        for (int j = 0; j < 4; ++j) {
            __m256i lo[NV][HALVES], hi[NV][HALVES];
            for (int v = 0; v < NV; ++v)
                for (int h = 0; h < HALVES; ++h) {
                    const uint8_t* p = w + (v * k32 + b) * 256 + j * 64 + h * HALF_BYTES;
                    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
                    lo[v][h] = _mm256_and_si256(packed, low);
                    hi[v][h] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                }
            for (int r = 0; r < ROWS; ++r) {
                const __m256i first = broadcast4(x.q[r] + b * BLOCK + 4 * j);
                const __m256i second = broadcast4(x.q[r] + b * BLOCK + 16 + 4 * j);
                for (int v = 0; v < NV; ++v)
                    for (int h = 0; h < HALVES; ++h) {
                        const __m256i low_half = _mm256_maddubs_epi16(lo[v][h], first);
                        const __m256i high_half = _mm256_maddubs_epi16(hi[v][h], second);
                        const __m256i both = _mm256_add_epi16(low_half, high_half);
                        pairs[r][v][h] = _mm256_add_epi16(pairs[r][v][h], both);
                    }
            }
        }
        for (int r = 0; r < ROWS; ++r) {
            const __m256 d = _mm256_set1_ps(x.d[r][b]);
            const __m256 dsum = _mm256_set1_ps(x.dsum[r][b]);
            for (int v = 0; v < NV; ++v)
                for (int h = 0; h < HALVES; ++h) {
                    const float* s = sz + (v * k32 + b) * 2 * COLS + h * 8;
                    const __m256 dot = _mm256_cvtepi32_ps(widen_pairs(pairs[r][v][h]));
                    const __m256 part = _mm256_mul_ps(dot, d);
                    acc[r][v][h] = _mm256_fmadd_ps(part, _mm256_loadu_ps(s), acc[r][v][h]);
                    acc[r][v][h] = _mm256_fmadd_ps(_mm256_loadu_ps(s + COLS), dsum, acc[r][v][h]);
                }
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < NV; ++v)
            for (int h = 0; h < HALVES; ++h)
                _mm256_storeu_ps(out + r * out_stride + v * COLS + h * 8, acc[r][v][h]);
}

// int8: the stored byte is q + 128, so q = byte ^ 0x80 as a signed byte. vpmaddubsw takes
// |q| as the unsigned operand and the activation with q's sign (vpsignb; zero where q is
// 0): a pair is at most 2 * 128 * 127 = 32512 (q = -128 included, activations -127..127),
// exact in int16 but not twice over, so each is widened to int32 at once. No 128 * sum(q)
// correction: the products are of q itself.
// BLOCKS: int8 in blocks of 32 (GGUF's Q8_0): each block's sums scaled by its own
// channel scales (sz [k32][16] per column block) rather than once at the end.
template <int ROWS, int NV, bool BLOCKS = false>
void int8_tile(const uint8_t* w, const float* scale, int64_t k32, const TileRows<ROWS>& x,
               const Prefetch& next, float* out, int64_t out_stride) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256 acc[ROWS][NV][HALVES];
    set_all(acc, _mm256_setzero_ps());
    for (int64_t b = 0; b < k32; ++b) {
        next.block(b);
        __m256i dot[ROWS][NV][HALVES];
        set_all(dot, _mm256_setzero_si256());
        for (int j = 0; j < 8; ++j) {
            __m256i q[NV][HALVES], magnitude[NV][HALVES];
            for (int v = 0; v < NV; ++v)
                for (int h = 0; h < HALVES; ++h) {
                    const uint8_t* p = w + (v * k32 + b) * 512 + j * 64 + h * HALF_BYTES;
                    q[v][h] = _mm256_xor_si256(
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), flip);
                    magnitude[v][h] = _mm256_abs_epi8(q[v][h]);  // -128 -> 0x80 = 128 unsigned
                }
            for (int r = 0; r < ROWS; ++r) {
                const __m256i a = broadcast4(x.q[r] + b * BLOCK + 4 * j);
                for (int v = 0; v < NV; ++v)
                    for (int h = 0; h < HALVES; ++h) {
                        const __m256i signed_a = _mm256_sign_epi8(a, q[v][h]);
                        const __m256i pairs = _mm256_maddubs_epi16(magnitude[v][h], signed_a);
                        dot[r][v][h] = _mm256_add_epi32(dot[r][v][h], widen_pairs(pairs));
                    }
            }
        }
        for (int r = 0; r < ROWS; ++r) {
            const __m256 d = _mm256_set1_ps(x.d[r][b]);
            for (int v = 0; v < NV; ++v)
                for (int h = 0; h < HALVES; ++h) {
                    const __m256 dot_f = _mm256_cvtepi32_ps(dot[r][v][h]);
                    if constexpr (BLOCKS) {
                        const __m256 s = _mm256_loadu_ps(scale + (v * k32 + b) * COLS + h * 8);
                        acc[r][v][h] = _mm256_fmadd_ps(_mm256_mul_ps(dot_f, d), s, acc[r][v][h]);
                    } else {
                        acc[r][v][h] = _mm256_fmadd_ps(dot_f, d, acc[r][v][h]);
                    }
                }
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < NV; ++v)
            for (int h = 0; h < HALVES; ++h) {
                __m256 y = acc[r][v][h];
                if constexpr (!BLOCKS) y = _mm256_mul_ps(y, _mm256_loadu_ps(scale + v * COLS + h * 8));
                _mm256_storeu_ps(out + r * out_stride + v * COLS + h * 8, y);
            }
}

template <int ROWS, int NV>
void tile(int format, const uint8_t* w, const float* sz, const QuantizedRows& a, int64_t r0,
          const Prefetch& next, float* out, int64_t out_stride) {
    const TileRows<ROWS> x(a, r0);
    if (format == QUANT_INT4) int4_tile<ROWS, NV>(w, sz, a.k32, x, next, out, out_stride);
    else if (format == QUANT_INT8) int8_tile<ROWS, NV>(w, sz, a.k32, x, next, out, out_stride);
    else int8_tile<ROWS, NV, true>(w, sz, a.k32, x, next, out, out_stride);
}

// 4 rows x 2 blocks (32 channels): 3x2, 6x1 and 8x1 were within 5% of it, 2x2, 4x1, 1x4
// and 2x4 10-30% slower (one thread, 3072x576 at 8-128 rows, int4 and int8). Its sums do
// not all fit the 16 ymm registers; the float accumulators, touched once per 32-column
// block, are the ones that spill.
constexpr int TILE_ROWS = 4;
constexpr int TILE_BLOCKS = 2;

// The tile of `nv` blocks (NV down to 1): one template per shape keeps the sums in registers.
template <int ROWS, int NV = TILE_BLOCKS>
void tile_blocks(int nv, int format, const uint8_t* w, const float* sz, const QuantizedRows& a,
                 int64_t r0, const Prefetch& next, float* out, int64_t out_stride) {
    if constexpr (NV > 1) {
        if (nv < NV)
            return tile_blocks<ROWS, NV - 1>(nv, format, w, sz, a, r0, next, out, out_stride);
    }
    tile<ROWS, NV>(format, w, sz, a, r0, next, out, out_stride);
}

// A tile of `rows` (1..TILE_ROWS) x `nv` (1..TILE_BLOCKS) blocks (ROWS down to 1).
template <int ROWS = TILE_ROWS>
void vector_tile(int rows, int nv, int format, const uint8_t* w, const float* sz,
                 const QuantizedRows& a, int64_t r0, const Prefetch& next, float* out,
                 int64_t out_stride) {
    if constexpr (ROWS > 1) {
        if (rows < ROWS)
            return vector_tile<ROWS - 1>(rows, nv, format, w, sz, a, r0, next, out, out_stride);
    }
    tile_blocks<ROWS>(nv, format, w, sz, a, r0, next, out, out_stride);
}

}  // namespace cadence_quant
