// The AMX-INT8 tiles of quant_kernels.cpp: the same product as the VNNI tiles of
// quant_tiles_avx512.h, its int32 dot products by tdpbsud (a 16-row x 32-byte tile of
// signed activations times an 8 x 64-byte tile of unsigned weights: 16 x 16 sums of 32
// products each, one instruction). Written once over a tile interface (amx_tiles.h):
// HardwareTiles on a CPU with AMX, EmulatedTiles (the SDM's definitions) anywhere, which
// is how it is tested where there is no AMX. Included by the AVX-512 VNNI build only.
//
// The packed weights are already AMX's B-tile layout: an int8 block (16 channels x 32
// inputs) is 8 rows of 64 bytes, row j holding channel c's inputs 4j..4j+3 at bytes
// 4c..4c+3. An int4 block's 256 bytes hold inputs 4j+i in the low nibbles of its 4 rows and
// 16+4j+i in the high ones: unpacked once per column block (all of K) into a panel of such
// tiles, low nibbles rows 0-3 and high ones rows 4-7, which every row tile then reads.
//
// Per 32-input block: C tiles zeroed, tdpbsud, C stored, then the block's scales applied
// with AVX-512 in the VNNI tiles' float operations and order, so both products are bitwise
// equal (int32 dot products are exact either way). Tiles: C[a][v] = 2a + v (16 rows x 16
// int32), A[a] = 4 + a (16 rows of 32 activation bytes), B[v] = 6 + v (8 x 64 weight bytes):
// 2 A x 2 B tiles = 32 rows x 32 channels a block, all 8 tile registers. Rows come in whole
// A tiles: the caller pads the activations with zero rows to a multiple of 16, so the
// tiles' shapes are configured once per thread and call; only real rows are stored.

#pragma once

#include "amx_tiles.h"
#include "cpu_kernels.h"
#include "quant_rows.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace cadence_quant::amx {

using cadence_amx::TileConfig;
using cadence_kernels::QUANT_INT4;
using cadence_kernels::QUANT_INT8;
using cadence_kernels::QUANT_INT8_BLOCKS;

constexpr int TILE_ROWS = 16;                       // rows of an A (and C) tile
constexpr int GROUP_TILES = 2;                      // A tiles (and B tiles) at once
constexpr int GROUP_ROWS = GROUP_TILES * TILE_ROWS;  // 32
constexpr int64_t B_BYTES = 512;                    // a B tile: 8 rows x 64 bytes
constexpr int A0 = 4, A1 = 5, B0 = 6, B1 = 7;       // C tiles are 0..3

inline TileConfig tile_config() {
    TileConfig cfg;
    for (int c = 0; c < 4; ++c) cfg.shape(c, TILE_ROWS, 64);  // 16 int32 columns
    cfg.shape(A0, TILE_ROWS, BLOCK);
    cfg.shape(A1, TILE_ROWS, BLOCK);
    cfg.shape(B0, BLOCK / 4, 64);
    cfg.shape(B1, BLOCK / 4, 64);
    return cfg;
}

// A column block's int4 weights [k32][256] as B tiles [k32][8][64]: the nibbles unpacked
// as the VNNI tiles unpack them.
inline void unpack_int4(const uint8_t* w, int64_t k32, uint8_t* out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < k32; ++b)
        for (int j = 0; j < 4; ++j) {
            const __m512i packed = _mm512_loadu_si512(w + b * 256 + j * 64);
            _mm512_storeu_si512(out + b * B_BYTES + j * 64, _mm512_and_si512(packed, low));
            _mm512_storeu_si512(out + b * B_BYTES + (4 + j) * 64,
                                _mm512_and_si512(_mm512_srli_epi16(packed, 4), low));
        }
}

// One 32-input block of NA A tiles x NV B tiles: dots[a * NV + v] the 16 x 16 int32 sums.
template <class Tiles, int NA, int NV>
CADENCE_AMX_TARGET inline void block_dots(const int8_t* x, int64_t x_stride, const uint8_t* w0,
                                          const uint8_t* w1, int32_t (*dots)[256]) {
    Tiles::template zero<0>();
    if constexpr (NV == 2) Tiles::template zero<1>();
    if constexpr (NA == 2) Tiles::template zero<2>();
    if constexpr (NA == 2 && NV == 2) Tiles::template zero<3>();
    Tiles::template load<A0>(x, x_stride);
    if constexpr (NA == 2) Tiles::template load<A1>(x + TILE_ROWS * x_stride, x_stride);
    Tiles::template load<B0>(w0, 64);
    if constexpr (NV == 2) Tiles::template load<B1>(w1, 64);
    Tiles::template dpbsud<0, A0, B0>();
    if constexpr (NV == 2) Tiles::template dpbsud<1, A0, B1>();
    if constexpr (NA == 2) Tiles::template dpbsud<2, A1, B0>();
    if constexpr (NA == 2 && NV == 2) Tiles::template dpbsud<3, A1, B1>();
    Tiles::template store<0>(dots[0], 64);
    if constexpr (NV == 2) Tiles::template store<1>(dots[1], 64);
    if constexpr (NA == 2) Tiles::template store<2>(dots[NV], 64);
    if constexpr (NA == 2 && NV == 2) Tiles::template store<3>(dots[3], 64);
}

// Rows r0 .. r0 + 16 NA of NV column blocks into acc [16 NA][16 NV]: w[v] the blocks' B
// tiles ([k32][512] each), s the first block's scales (block_scales floats a block).
template <class Tiles, int FORMAT, int NA, int NV>
CADENCE_AMX_TARGET void row_group(const uint8_t* const* w, const float* s, int64_t block_scales,
                                  const QuantizedRows& a, int64_t r0, float* acc) {
    constexpr int STRIDE = NV * COLS;  // acc's row stride
    const int64_t k32 = a.k32, x_stride = k32 * BLOCK;
    const int8_t* x = a.q.data() + r0 * x_stride;
    alignas(64) int32_t dots[NA * NV][256];
    for (int i = 0; i < NA * TILE_ROWS * STRIDE; i += COLS)
        _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
    for (int64_t b = 0; b < k32; ++b) {
        block_dots<Tiles, NA, NV>(x + b * BLOCK, x_stride, w[0] + b * B_BYTES,
                                  w[NV - 1] + b * B_BYTES, dots);
        for (int t = 0; t < NA; ++t)
            for (int i = 0; i < TILE_ROWS; ++i) {
                const int r = t * TILE_ROWS + i;
                const __m512 d = _mm512_set1_ps(a.d[(r0 + r) * k32 + b]);
                const float dsum = a.dsum[(r0 + r) * k32 + b];
                for (int v = 0; v < NV; ++v) {
                    float* out = acc + r * STRIDE + v * COLS;
                    const __m512i dot = _mm512_load_si512(dots[t * NV + v] + i * COLS);
                    const __m512 sum = _mm512_cvtepi32_ps(dot);
                    __m512 y = _mm512_loadu_ps(out);
                    // the VNNI tiles' operations, in their order (quant_tiles_avx512.h)
                    if constexpr (FORMAT == QUANT_INT4) {
                        const float* sz = s + v * block_scales + b * 2 * COLS;
                        const __m512 part = _mm512_mul_ps(sum, d);
                        y = _mm512_fmadd_ps(part, _mm512_loadu_ps(sz), y);
                        y = _mm512_fmadd_ps(_mm512_loadu_ps(sz + COLS), _mm512_set1_ps(dsum), y);
                    } else if constexpr (FORMAT == QUANT_INT8_BLOCKS) {
                        const __m512 shift = _mm512_set1_ps(-128.0f * dsum);
                        const __m512 scale = _mm512_loadu_ps(s + v * block_scales + b * COLS);
                        y = _mm512_fmadd_ps(_mm512_fmadd_ps(sum, d, shift), scale, y);
                    } else {
                        y = _mm512_fmadd_ps(sum, d, y);
                    }
                    _mm512_storeu_ps(out, y);
                }
            }
    }
    if constexpr (FORMAT == QUANT_INT8) {  // per channel: the row's correction, then the scale
        for (int r = 0; r < NA * TILE_ROWS; ++r)
            for (int v = 0; v < NV; ++v) {
                float* out = acc + r * STRIDE + v * COLS;
                const __m512 correction = _mm512_set1_ps(a.correction[r0 + r]);
                __m512 y = _mm512_sub_ps(_mm512_loadu_ps(out), correction);
                y = _mm512_mul_ps(y, _mm512_loadu_ps(s + v * COLS));
                _mm512_storeu_ps(out, y);
            }
    }
}

template <class Tiles, int FORMAT>
CADENCE_AMX_TARGET void row_group(int na, int nv, const uint8_t* const* w, const float* s,
                                  int64_t block_scales, const QuantizedRows& a, int64_t r0,
                                  float* acc) {
    if (na == 2 && nv == 2) row_group<Tiles, FORMAT, 2, 2>(w, s, block_scales, a, r0, acc);
    else if (na == 2) row_group<Tiles, FORMAT, 2, 1>(w, s, block_scales, a, r0, acc);
    else if (nv == 2) row_group<Tiles, FORMAT, 1, 2>(w, s, block_scales, a, r0, acc);
    else row_group<Tiles, FORMAT, 1, 1>(w, s, block_scales, a, r0, acc);
}

// One thread's share: column blocks [nb0, nb1) of every row, each row's values handed to
// store(row, first column, columns, values). The activations hold m rows padded with zero
// rows to a multiple of 16. Configures the tiles (their state is per thread) and releases
// them; returns Tiles::ok().
template <class Tiles, class Store>
CADENCE_AMX_TARGET bool column_blocks(int format, const uint8_t* packed, const float* sz,
                                      int64_t nb0, int64_t nb1, const QuantizedRows& a,
                                      int64_t m, int64_t n, const Store& store) {
    const int64_t k32 = a.k32, block_bytes = k32 * B_BYTES;
    // int8's scales are one per channel, the others' one per channel and input block
    const int64_t block_scales =
        format == QUANT_INT8 ? COLS : k32 * (format == QUANT_INT4 ? 2 * COLS : COLS);
    static thread_local std::vector<uint8_t> panel;  // int4's unpacked B tiles
    if (format == QUANT_INT4) panel.resize(GROUP_TILES * block_bytes);
    alignas(64) float acc[GROUP_ROWS * GROUP_TILES * COLS];
    Tiles::configure(tile_config());
    for (int64_t nb = nb0; nb < nb1; nb += GROUP_TILES) {
        const int nv = static_cast<int>(std::min<int64_t>(GROUP_TILES, nb1 - nb));
        const uint8_t* w[GROUP_TILES];
        for (int v = 0; v < nv; ++v) {
            if (format == QUANT_INT4) {
                unpack_int4(packed + (nb + v) * k32 * 256, k32, panel.data() + v * block_bytes);
                w[v] = panel.data() + v * block_bytes;
            } else {
                w[v] = packed + (nb + v) * block_bytes;
            }
        }
        const float* s = sz + nb * block_scales;
        const int64_t col0 = nb * COLS, cols = std::min<int64_t>(nv * COLS, n - col0);
        for (int64_t r0 = 0; r0 < m; r0 += GROUP_ROWS) {
            const int na = m - r0 > TILE_ROWS ? 2 : 1;
            if (format == QUANT_INT4)
                row_group<Tiles, QUANT_INT4>(na, nv, w, s, block_scales, a, r0, acc);
            else if (format == QUANT_INT8)
                row_group<Tiles, QUANT_INT8>(na, nv, w, s, block_scales, a, r0, acc);
            else row_group<Tiles, QUANT_INT8_BLOCKS>(na, nv, w, s, block_scales, a, r0, acc);
            const int64_t rows = std::min<int64_t>(GROUP_ROWS, m - r0);
            for (int64_t r = 0; r < rows; ++r) store(r0 + r, col0, cols, acc + r * nv * COLS);
        }
    }
    const bool ok = Tiles::ok();
    Tiles::release();
    return ok;
}

}  // namespace cadence_quant::amx
