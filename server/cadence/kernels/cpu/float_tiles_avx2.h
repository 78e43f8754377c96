// The AVX2 + FMA tiles of float_kernels.cpp: MR rows x NP panels of 16 output columns (two
// 8-lane halves each), every output one FMA chain over k ascending from +0 -- the chain the
// portable loop computes with std::fma, so the two give the same bits, and no tile shape,
// row count, thread or schedule changes a row's result.
//
// Which tile serves how many rows: one row 1 x 64 columns (4 panels: four weight streams
// in flight, eight independent chains), two rows 2 x 48, three 3 x 32, four to six rows
// x 16: 8-12 accumulators, the weights of a k step loaded once and each row's x broadcast.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace cadence_float {

constexpr int COLS = 16;      // output columns per panel
constexpr int ROW_BLOCK = 6;  // the most rows a tile takes

// Panels per tile for `rows` rows: as many accumulators as the 16 ymm registers hold
// beside the weights and broadcasts.
template <int ROWS>
constexpr int panels_for() {
    return ROWS == 1 ? 4 : ROWS == 2 ? 3 : ROWS == 3 ? 2 : 1;
}

// x: element (r, k) at x[r * rs + k * ks] (rows in place: rs the row stride, ks 1; a packed
// strip of ROW_BLOCK rows: rs 1, ks ROW_BLOCK). w: the first panel's column block at k = 0,
// panels `pstride` floats apart, a k step 16 floats. y: element (r, c) at y[r * ys + c].
// `ahead`: bytes after each panel's k step to prefetch (the next panels), 0 for none.
template <int ROWS, int NP>
inline void tile(const float* __restrict x, int64_t rs, int64_t ks, const float* __restrict w,
                 int64_t pstride, int64_t k, float* __restrict y, int64_t ys, int64_t ahead) {
    __m256 acc[ROWS][NP][2];
    #pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r)
        #pragma GCC unroll 16
        for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; ++i) {
        const float* wk = w + i * COLS;
        if (ahead) {
            #pragma GCC unroll 16
            for (int p = 0; p < NP; ++p)
                _mm_prefetch(reinterpret_cast<const char*>(wk + p * pstride) + ahead, _MM_HINT_T0);
        }
        const float* xk = x + i * ks;
        __m256 wv[NP][2];
        #pragma GCC unroll 16
        for (int p = 0; p < NP; ++p) {
            wv[p][0] = _mm256_load_ps(wk + p * pstride);
            wv[p][1] = _mm256_load_ps(wk + p * pstride + 8);
        }
        #pragma GCC unroll 16
        for (int r = 0; r < ROWS; ++r) {
            const __m256 b = _mm256_broadcast_ss(xk + r * rs);
            #pragma GCC unroll 16
            for (int p = 0; p < NP; ++p) {
                acc[r][p][0] = _mm256_fmadd_ps(b, wv[p][0], acc[r][p][0]);
                acc[r][p][1] = _mm256_fmadd_ps(b, wv[p][1], acc[r][p][1]);
            }
        }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r)
        #pragma GCC unroll 16
        for (int p = 0; p < NP; ++p) {
            _mm256_storeu_ps(y + r * ys + p * COLS, acc[r][p][0]);
            _mm256_storeu_ps(y + r * ys + p * COLS + 8, acc[r][p][1]);
        }
}

// The last panel when it holds fewer than 16 real columns: a full tile into a scratch
// block, its first `cols` columns copied out.
template <int ROWS>
inline void partial_tile(const float* x, int64_t rs, int64_t ks, const float* w, int64_t k,
                         float* y, int64_t ys, int cols) {
    alignas(32) float scratch[ROWS * COLS];
    tile<ROWS, 1>(x, rs, ks, w, 0, k, scratch, COLS, 0);
    for (int r = 0; r < ROWS; ++r) std::copy(scratch + r * COLS, scratch + r * COLS + cols, y + r * ys);
}

// ROWS rows over panels [p0, p1) of a weight of n columns: the widest tiles first, then
// narrower ones, then the partial panel.
template <int ROWS>
void row_block(const float* x, int64_t rs, int64_t ks, const float* w, int64_t k, int64_t n,
               int64_t p0, int64_t p1, float* y, int64_t ys, int64_t ahead) {
    constexpr int WIDE = panels_for<ROWS>();
    const int64_t pstride = k * COLS;
    const int64_t full = std::min(p1, n / COLS);
    int64_t p = p0;
    for (; p + WIDE <= full; p += WIDE)
        tile<ROWS, WIDE>(x, rs, ks, w + p * pstride, pstride, k, y + p * COLS, ys, ahead);
    if constexpr (WIDE > 2) {
        for (; p + 2 <= full; p += 2)
            tile<ROWS, 2>(x, rs, ks, w + p * pstride, pstride, k, y + p * COLS, ys, ahead);
    }
    for (; p < full; ++p)
        tile<ROWS, 1>(x, rs, ks, w + p * pstride, pstride, k, y + p * COLS, ys, ahead);
    if (p < p1)
        partial_tile<ROWS>(x, rs, ks, w + p * pstride, k, y + p * COLS, ys,
                           static_cast<int>(n - p * COLS));
}

inline void row_block(int rows, const float* x, int64_t rs, int64_t ks, const float* w,
                      int64_t k, int64_t n, int64_t p0, int64_t p1, float* y, int64_t ys,
                      int64_t ahead) {
    switch (rows) {
        case 1: row_block<1>(x, rs, ks, w, k, n, p0, p1, y, ys, ahead); break;
        case 2: row_block<2>(x, rs, ks, w, k, n, p0, p1, y, ys, ahead); break;
        case 3: row_block<3>(x, rs, ks, w, k, n, p0, p1, y, ys, ahead); break;
        case 4: row_block<4>(x, rs, ks, w, k, n, p0, p1, y, ys, ahead); break;
        case 5: row_block<5>(x, rs, ks, w, k, n, p0, p1, y, ys, ahead); break;
        default: row_block<6>(x, rs, ks, w, k, n, p0, p1, y, ys, ahead); break;
    }
}

}  // namespace cadence_float
