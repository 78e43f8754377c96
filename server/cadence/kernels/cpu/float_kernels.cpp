// float32 products on a prepacked weight: y = x @ W.T with W in panels of 16 output columns
// (cadence/layers/packed.py packs it: packed [n16][k][16], zero columns past n).
//
// Why: oneDNN's prepacked float32 product reads SmolLM2's weights at ~10 GB/s for one row
// on a 2-core Zen 3 (a matrix-vector path) and reaches a third of the FMA peak at 32 rows;
// these tiles read them at ~20 GB/s for one row and stay ahead up to a few hundred rows,
// about equal above (docs/benchmarks.md).
//
// Every output is ONE FMA chain over k ascending, from +0: acc = fma(x[r, i], W[c, i], acc).
// The vector tiles (float_tiles_avx2.h) and the portable loop below compute exactly that,
// so every build gives the same bits, and nothing about a call -- how many rows, where a
// row sits, which tile or thread computes it -- can change a row's result: batch
// invariance by construction (cadence/shard/determinism.py still checks it at start).
//
// Fewer than LARGE rows read x in place: the threads claim runs of panels from a queue
// (work_queue.h), in groups of GROUP panels; every row block passes over a group while it
// is in cache, and the first row block prefetches the next group. From LARGE rows x is first copied into strips
// of ROW_BLOCK rows, k-major (a tile's broadcasts then read one cache line per k step), and
// the threads take panels one at a time (a thread that loses its core holds up one panel).

#include "cpu_kernels.h"
#include "work_queue.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include "float_tiles_avx2.h"
#define CADENCE_FLOAT_TILES 1
#endif

namespace {

using cadence_kernels::OK;

constexpr int64_t COLS = 16;
constexpr int64_t ROW_BLOCK = 6;
constexpr int64_t GROUP = 4;    // panels a thread's row blocks pass over together
constexpr int64_t LARGE = 160;  // rows from which x is copied into strips first

// Row block b of `blocks` over m rows starts here: blocks differ by one row at most (8
// rows are 4 + 4, not 6 + 2; which rows go together never changes a row's bits).
inline int64_t block_start(int64_t m, int64_t blocks, int64_t b) { return m * b / blocks; }

#ifdef CADENCE_FLOAT_TILES

void small_product(const float* x, int64_t xs, int64_t m, int64_t k, const float* w, int64_t n,
                   float* y, int64_t ys, int threads) {
    const int64_t panels = (n + COLS - 1) / COLS;
    const int64_t blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t next_group = GROUP * k * COLS * static_cast<int64_t>(sizeof(float));
    cadence_kernels::WorkQueue queue(panels, threads, GROUP);  // runs of panels, claimed
#pragma omp parallel num_threads(threads)
    {
        int64_t p0 = 0, p1 = 0;
        while (queue.claim(p0, p1)) {
            for (int64_t g = p0; g < p1; g += GROUP) {
                const int64_t g1 = std::min(p1, g + GROUP);
                for (int64_t b = 0; b < blocks; ++b) {
                    const int64_t r0 = block_start(m, blocks, b);
                    const int rows = static_cast<int>(block_start(m, blocks, b + 1) - r0);
                    // one row alone: the hardware prefetcher keeps up with four streams
                    const int64_t ahead = b == 0 && blocks > 1 ? next_group : 0;
                    cadence_float::row_block(rows, x + r0 * xs, xs, 1, w, k, n, g, g1,
                                             y + r0 * ys, ys, ahead);
                }
            }
        }
    }
}

void large_product(const float* x, int64_t xs, int64_t m, int64_t k, const float* w, int64_t n,
                   float* y, int64_t ys, int threads) {
    const int64_t panels = (n + COLS - 1) / COLS;
    const int64_t blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
    std::vector<float> strips(static_cast<size_t>(blocks * ROW_BLOCK * k));
#pragma omp parallel num_threads(threads)
    {
        // strip b: element (r, i) at [b][i][r], rows past the block's zero
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            float* strip = strips.data() + b * ROW_BLOCK * k;
            const int64_t r0 = block_start(m, blocks, b), rows = block_start(m, blocks, b + 1) - r0;
            for (int64_t r = 0; r < ROW_BLOCK; ++r)
                for (int64_t i = 0; i < k; ++i)
                    strip[i * ROW_BLOCK + r] = r < rows ? x[(r0 + r) * xs + i] : 0.0f;
        }
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t p = 0; p < panels; ++p)
            for (int64_t b = 0; b < blocks; ++b) {
                const int64_t r0 = block_start(m, blocks, b);
                const int rows = static_cast<int>(block_start(m, blocks, b + 1) - r0);
                cadence_float::row_block(rows, strips.data() + b * ROW_BLOCK * k, 1, ROW_BLOCK, w, k,
                                         n, p, p + 1, y + r0 * ys, ys, 0);
            }
    }
}

#else

// The same chains without vectors (the scalar build): column by column.
void portable_product(const float* x, int64_t xs, int64_t m, int64_t k, const float* w,
                      int64_t n, float* y, int64_t ys, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < n; ++c) {
        const float* panel = w + (c / COLS) * k * COLS + c % COLS;
        for (int64_t r = 0; r < m; ++r) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; ++i) acc = std::fma(x[r * xs + i], panel[i * COLS], acc);
            y[r * ys + c] = acc;
        }
    }
}

#endif

}  // namespace

extern "C" {

int cadence_float_matmul(const float* x, int64_t x_stride, int64_t m, int64_t k,
                         const float* packed, int64_t n, float* y, int64_t y_stride,
                         int num_threads) {
    if (m == 0 || n == 0) return OK;
    const int64_t panels = (n + COLS - 1) / COLS;
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, panels)));
#ifdef CADENCE_FLOAT_TILES
    if (m < LARGE) {
        small_product(x, x_stride, m, k, packed, n, y, y_stride, threads);
    } else {
        large_product(x, x_stride, m, k, packed, n, y, y_stride, threads);
    }
#else
    portable_product(x, x_stride, m, k, packed, n, y, y_stride, threads);
#endif
    return OK;
}

}  // extern "C"
