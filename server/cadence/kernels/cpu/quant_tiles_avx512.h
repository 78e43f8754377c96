// The AVX-512 VNNI tiles of quant_kernels.cpp: up to 4 rows x 4 blocks of 16 output
// channels, the int32 dot products by vpdpbusd (64 unsigned x signed byte products into
// 16 sums per instruction). Included by quant_kernels.cpp in the builds that have VNNI.

#pragma once

#include "cpu_kernels.h"
#include "quant_rows.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace cadence_quant {

using cadence_kernels::QUANT_INT4;
using cadence_kernels::QUANT_INT8;

// quant_kernels.cpp's quantize_block_portable, 16 lanes at a time: the same division,
// the same products and the same rounding (vcvtps2dq rounds to nearest even, as nearbyint
// does in the default rounding mode), so both builds quantize to the same bytes.
#define CADENCE_QUANT_VECTOR_QUANTIZE 1

inline __m512 load16(const void* x, int64_t at, __mmask16 lanes, int dtype) {
    if (dtype == cadence_kernels::BF16) {
        const __m256i h = _mm256_maskz_loadu_epi16(lanes, static_cast<const uint16_t*>(x) + at);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(lanes, static_cast<const float*>(x) + at);
}

inline __mmask16 lanes_before(int64_t first, int64_t end) {  // lanes first.. first+15 below end
    const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, end - first));
    return static_cast<__mmask16>((1u << n) - 1u);
}

inline BlockQuantized quantize_block_vector(const void* x, int64_t base, int64_t col0,
                                            int64_t k, int dtype, int8_t* q) {
    const __m512 lo = load16(x, base + col0, lanes_before(col0, k), dtype);
    const __m512 hi = load16(x, base + col0 + 16, lanes_before(col0 + 16, k), dtype);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 scale = _mm512_set1_ps(inv);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
    return {amax / 127.0f, _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi))};
}

inline __m512i broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// ROWS rows x NV 16-column blocks. Per 32-column block: 8 vpdpbusd per row and column
// block into int32 sums (each broadcast of 4 activations feeds NV of them, each unpacked
// weight vector ROWS), then the block's scales: acc += (sum * d) * scale + zero' * d * sum(q).
// Every sum and accumulator is a register (2 x ROWS x NV of AVX-512's 32): see TILE_BLOCKS.
template <int ROWS, int NV>
void int4_tile(const uint8_t* w, const float* sz, int64_t k32, const TileRows<ROWS>& x,
               const Prefetch& next, float* out, int64_t out_stride) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[ROWS][NV];
    set_all(acc, _mm512_setzero_ps());
    for (int64_t b = 0; b < k32; ++b) {
        next.block(b);
        __m512i dot[ROWS][NV];
        set_all(dot, _mm512_setzero_si512());
        for (int j = 0; j < 4; ++j) {
            __m512i lo[NV], hi[NV];
            for (int v = 0; v < NV; ++v) {
                const __m512i packed = _mm512_loadu_si512(w + (v * k32 + b) * 256 + j * 64);
                lo[v] = _mm512_and_si512(packed, low);
                hi[v] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            }
            for (int r = 0; r < ROWS; ++r) {
                const __m512i first = broadcast4(x.q[r] + b * BLOCK + 4 * j);
                const __m512i second = broadcast4(x.q[r] + b * BLOCK + 16 + 4 * j);
                for (int v = 0; v < NV; ++v) {
                    dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], lo[v], first);
                    dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], hi[v], second);
                }
            }
        }
        for (int r = 0; r < ROWS; ++r) {
            const __m512 d = _mm512_set1_ps(x.d[r][b]);
            const __m512 dsum = _mm512_set1_ps(x.dsum[r][b]);
            for (int v = 0; v < NV; ++v) {
                const float* s = sz + (v * k32 + b) * 2 * COLS;
                const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][v]), d);
                acc[r][v] = _mm512_fmadd_ps(part, _mm512_loadu_ps(s), acc[r][v]);
                acc[r][v] = _mm512_fmadd_ps(_mm512_loadu_ps(s + COLS), dsum, acc[r][v]);
            }
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + r * out_stride + v * COLS, acc[r][v]);
}

// int8: the weights are the unsigned operand (q + 128). Per channel (BLOCKS false): sum *
// d per block, then the row's 128 * sum of d * sum(q) off and the channel scale on. In
// blocks of 32 (GGUF's Q8_0, BLOCKS true): per block acc += (sum * d - 128 * d * sum(q)) *
// the block's channel scales (sz [k32][16] per column block).
template <int ROWS, int NV, bool BLOCKS>
void int8_tile(const uint8_t* w, const float* scale, int64_t k32, const TileRows<ROWS>& x,
               const float* correction, const Prefetch& next, float* out, int64_t out_stride) {
    __m512 acc[ROWS][NV];
    set_all(acc, _mm512_setzero_ps());
    for (int64_t b = 0; b < k32; ++b) {
        next.block(b);
        __m512i dot[ROWS][NV];
        set_all(dot, _mm512_setzero_si512());
        for (int j = 0; j < 8; ++j) {
            __m512i q[NV];
            for (int v = 0; v < NV; ++v)
                q[v] = _mm512_loadu_si512(w + (v * k32 + b) * 512 + j * 64);
            for (int r = 0; r < ROWS; ++r) {
                const __m512i a = broadcast4(x.q[r] + b * BLOCK + 4 * j);
                for (int v = 0; v < NV; ++v) dot[r][v] = _mm512_dpbusd_epi32(dot[r][v], q[v], a);
            }
        }
        for (int r = 0; r < ROWS; ++r) {
            const __m512 d = _mm512_set1_ps(x.d[r][b]);
            for (int v = 0; v < NV; ++v) {
                const __m512 sum = _mm512_cvtepi32_ps(dot[r][v]);
                if constexpr (BLOCKS) {
                    const __m512 shift = _mm512_set1_ps(-128.0f * x.dsum[r][b]);
                    const __m512 s = _mm512_loadu_ps(scale + (v * k32 + b) * COLS);
                    acc[r][v] = _mm512_fmadd_ps(_mm512_fmadd_ps(sum, d, shift), s, acc[r][v]);
                } else {
                    acc[r][v] = _mm512_fmadd_ps(sum, d, acc[r][v]);
                }
            }
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < NV; ++v) {
            __m512 y = acc[r][v];
            if constexpr (!BLOCKS) {
                y = _mm512_sub_ps(y, _mm512_set1_ps(correction[r]));
                y = _mm512_mul_ps(y, _mm512_loadu_ps(scale + v * COLS));
            }
            _mm512_storeu_ps(out + r * out_stride + v * COLS, y);
        }
}

template <int ROWS, int NV>
void tile(int format, const uint8_t* w, const float* sz, const QuantizedRows& a, int64_t r0,
          const Prefetch& next, float* out, int64_t out_stride) {
    const TileRows<ROWS> x(a, r0);
    if (format == QUANT_INT4) int4_tile<ROWS, NV>(w, sz, a.k32, x, next, out, out_stride);
    else if (format == QUANT_INT8)
        int8_tile<ROWS, NV, false>(w, sz, a.k32, x, a.correction.data() + r0, next, out, out_stride);
    else int8_tile<ROWS, NV, true>(w, sz, a.k32, x, nullptr, next, out, out_stride);
}

template <int ROWS>
void tile_blocks(int nv, int format, const uint8_t* w, const float* sz, const QuantizedRows& a,
                 int64_t r0, const Prefetch& next, float* out, int64_t out_stride) {
    switch (nv) {
        case 1: tile<ROWS, 1>(format, w, sz, a, r0, next, out, out_stride); break;
        case 2: tile<ROWS, 2>(format, w, sz, a, r0, next, out, out_stride); break;
        default: tile<ROWS, 3>(format, w, sz, a, r0, next, out, out_stride); break;
    }
}

// A tile of `rows` (1..4) x `nv` (1..3) blocks: one template each keeps the sums in registers.
void vector_tile(int rows, int nv, int format, const uint8_t* w, const float* sz,
                 const QuantizedRows& a, int64_t r0, const Prefetch& next, float* out,
                 int64_t out_stride) {
    switch (rows) {
        case 1: tile_blocks<1>(nv, format, w, sz, a, r0, next, out, out_stride); break;
        case 2: tile_blocks<2>(nv, format, w, sz, a, r0, next, out, out_stride); break;
        case 3: tile_blocks<3>(nv, format, w, sz, a, r0, next, out, out_stride); break;
        default: tile_blocks<4>(nv, format, w, sz, a, r0, next, out, out_stride); break;
    }
}

// 4 rows x 3 blocks: 24 sums and accumulators leave registers for the weights and the
// broadcast. 4 x 4 (32 of them, so some spill) was 0.85x as fast at 128-320 rows and on
// the 49152-row LM head at 32 (Zen 4, SmolLM2-135M's shapes; 1-8 rows within noise).
constexpr int TILE_ROWS = 4;
constexpr int TILE_BLOCKS = 3;

}  // namespace cadence_quant
