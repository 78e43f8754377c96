// bfloat16 products on AMX-BF16 tiles: y = x @ W.T, x and y bfloat16, W prepacked as AMX's
// B tiles (cadence/layers/packed.py, `amx_bf16_packing`): packed [n16][k32][16][32], tile
// (nb, kb) row p holding, for each of channels 16 nb .. 16 nb + 15, its inputs
// 32 kb + 2p and 32 kb + 2p + 1 (zero past n and k).
//
// Why: on a Sapphire Rapids oneDNN's bfloat16 product runs on these tiles too, but a row's
// bits change with the number of rows from 33 on, so batch-invariant serving splits it
// into 32-row products and joins them with a copy (half its speed at a 320-row prefill
// chunk). Here every output is one tdpbf16ps chain over k ascending from +0, whatever the
// call: which rows go with it, where it sits in its tile, which thread computes it. So a
// row's bits never depend on the others' -- batch invariance by construction
// (cadence/shard/determinism.py still checks it at start) -- and the product takes every
// row count in one call.
//
// Tiles: C[a][v] = 2a + v (16 rows x 16 fp32), A[a] = 4 + a (16 rows x 32 bf16 of x),
// B[v] = 6 + v (one packed tile): 32 rows x 32 channels at a time, all 8 tile registers.
// Threads claim runs of column-block pairs from a shared queue (work_queue.h: each weight
// tile streams once per call, a slowed core takes fewer); a thread passes every row group
// over a pair of column blocks while its 2 x k32 tiles are in cache; the first row group
// asks for the tiles PREFETCH_TILES input blocks ahead (the hardware's stream prefetch
// alone left a 32-row decode product at two thirds of the memory's read speed). Rows come from x in place where k is a multiple of 32 and a whole A tile
// is there; the last partial tile (and every tile where k is not) is copied into a
// zero-padded strip first. cadence_bf16_matmul_tiles_swiglu multiplies a fused gate/up
// weight the same way, gate block j and up block j as one pair, and writes SwiGLU of the
// pair's rounded sums (silu_mul's arithmetic) instead of the sums.

#include "cpu_kernels.h"
#include "work_queue.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "amx_tiles.h"
#include "fast_exp.h"  // silu_mul16
#define CADENCE_BF16_AMX 1
#endif

namespace {

using cadence_kernels::OK;
using cadence_kernels::WorkQueue;

#ifdef CADENCE_BF16_AMX
using cadence_amx::TileConfig;
using cadence_kernels::BAD_TILES;
using cadence_kernels::NO_AMX;
using cadence_kernels::TILE_FAULT;
using cadence_kernels::TILES_AMX;
using cadence_kernels::TILES_EMULATED;

constexpr int64_t ROWS = 16;   // rows of an A (and C) tile
constexpr int64_t COLS = 16;   // channels of a B (and C) tile
constexpr int64_t K_STEP = 32;  // inputs of one A row (64 bytes of bf16)
constexpr int64_t TILE_ELEMS = 16 * 32;  // bf16 elements of a packed B tile
constexpr int A0 = 4, A1 = 5, B0 = 6, B1 = 7;
constexpr int64_t PREFETCH_TILES = 2;  // how far ahead of its loads a pass asks for B tiles

std::atomic<bool> amx_bf16_granted{false};

TileConfig tile_config() {
    TileConfig cfg;
    for (int c = 0; c < 4; ++c) cfg.shape(c, ROWS, 64);
    cfg.shape(A0, ROWS, 64);
    cfg.shape(A1, ROWS, 64);
    cfg.shape(B0, K_STEP / 2, 64);
    cfg.shape(B1, K_STEP / 2, 64);
    return cfg;
}

// Where the A tiles of rows r0 .. r0 + 16 na read from: x itself (k a multiple of 32), or a
// zero-padded copy in `strip` when the tiles would read rows past m (the last row group's).
struct RowSource {
    const uint16_t* base;
    int64_t stride;  // elements between rows
};

RowSource rows_at(const uint16_t* x, int64_t xs, int64_t m, int64_t k, int64_t k32, int64_t r0,
                  int64_t na, std::vector<uint16_t>& strip) {
    if (r0 + na * ROWS <= m) return {x + r0 * xs, xs};
    const int64_t width = k32 * K_STEP;
    strip.assign(na * ROWS * width, 0);
    for (int64_t r = r0; r < std::min(m, r0 + na * ROWS); ++r)
        std::memcpy(strip.data() + (r - r0) * width, x + r * xs, k * sizeof(uint16_t));
    return {strip.data(), width};
}

// A packed B tile's 16 rows of 64 bytes, asked for into L1.
inline void prefetch_tile(const uint16_t* tile) {
    const char* p = reinterpret_cast<const char*>(tile);
    for (int64_t line = 0; line < TILE_ELEMS * 2; line += 64) _mm_prefetch(p + line, _MM_HINT_T0);
}

// NA A tiles x NV column blocks over every input block into `acc` [16 NA][16 NV] fp32;
// STREAM: the weight tiles come from memory (a pair's first row group), so each step asks
// for those PREFETCH_TILES ahead (past the pair's end: the next pair's, which follows it).
template <class Tiles, int NA, int NV, bool STREAM>
CADENCE_AMX_BF16_TARGET void row_group(RowSource a, const uint16_t* w0, const uint16_t* w1,
                                       int64_t k32, float* acc) {
    Tiles::template zero<0>();
    if constexpr (NV == 2) Tiles::template zero<1>();
    if constexpr (NA == 2) Tiles::template zero<2>();
    if constexpr (NA == 2 && NV == 2) Tiles::template zero<3>();
    const int64_t a_stride = a.stride * 2;  // bytes
    // Tile registers are not renamed: a load into one waits for every product reading it.
    // So each next input block's tile is loaded right after the last product that reads
    // its register, not all at the top of the step, where (2 x 2) A1's load waited on the
    // last product and held the others behind it (2-8% of a 30-layer product at 32-960
    // rows on an Emerald Rapids). Each C tile's chain over kb is unchanged: same bits.
    const uint16_t* x1 = NA == 2 ? a.base + ROWS * a.stride : a.base;
    Tiles::template load<A0>(a.base, a_stride);
    if constexpr (NA == 2) Tiles::template load<A1>(x1, a_stride);
    Tiles::template load<B0>(w0, 64);
    if constexpr (NV == 2) Tiles::template load<B1>(w1, 64);
    for (int64_t kb = 0; kb < k32; ++kb) {
        if constexpr (STREAM) {
            prefetch_tile(w0 + (kb + PREFETCH_TILES) * TILE_ELEMS);
            if constexpr (NV == 2) prefetch_tile(w1 + (kb + PREFETCH_TILES) * TILE_ELEMS);
        }
        const bool more = kb + 1 < k32;
        const int64_t next = (kb + 1) * K_STEP, next_tile = (kb + 1) * TILE_ELEMS;
        Tiles::template dpbf16ps<0, A0, B0>();
        if constexpr (NV == 2) Tiles::template dpbf16ps<1, A0, B1>();
        if (more) Tiles::template load<A0>(a.base + next, a_stride);
        if constexpr (NA == 2) Tiles::template dpbf16ps<2, A1, B0>();
        if (more) Tiles::template load<B0>(w0 + next_tile, 64);
        if constexpr (NA == 2 && NV == 2) Tiles::template dpbf16ps<3, A1, B1>();
        if (more) {
            if constexpr (NV == 2) Tiles::template load<B1>(w1 + next_tile, 64);
            if constexpr (NA == 2) Tiles::template load<A1>(x1 + next, a_stride);
        }
    }
    constexpr int64_t STRIDE = NV * COLS * 4;  // acc's row, in bytes
    Tiles::template store<0>(acc, STRIDE);
    if constexpr (NV == 2) Tiles::template store<1>(acc + COLS, STRIDE);
    if constexpr (NA == 2) Tiles::template store<2>(acc + ROWS * NV * COLS, STRIDE);
    if constexpr (NA == 2 && NV == 2) Tiles::template store<3>(acc + ROWS * NV * COLS + COLS, STRIDE);
}

template <class Tiles, bool STREAM>
CADENCE_AMX_BF16_TARGET void row_group(int na, int nv, RowSource a, const uint16_t* w0,
                                       const uint16_t* w1, int64_t k32, float* acc) {
    if (na == 2 && nv == 2) row_group<Tiles, 2, 2, STREAM>(a, w0, w1, k32, acc);
    else if (na == 2) row_group<Tiles, 2, 1, STREAM>(a, w0, w1, k32, acc);
    else if (nv == 2) row_group<Tiles, 1, 2, STREAM>(a, w0, w1, k32, acc);
    else row_group<Tiles, 1, 1, STREAM>(a, w0, w1, k32, acc);
}

// fp32 sums to bfloat16 (round to nearest even), the first `cols` of a row.
void store_row(const float* v, int64_t cols, uint16_t* out) {
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(v + c));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), reinterpret_cast<const __m256i&>(h));
    }
    if (c < cols) {
        const __mmask16 keep = static_cast<__mmask16>((1u << (cols - c)) - 1);
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, v + c));
        _mm256_mask_storeu_epi16(out + c, keep, reinterpret_cast<const __m256i&>(h));
    }
}

// 16 float32 sums rounded to bfloat16 as store_row rounds them, held as float32 (what
// silu_mul reads back from the stored product).
inline __m512 as_stored(const float* v) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(v));
    const __m256i bits = reinterpret_cast<const __m256i&>(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// A pair of column blocks as the tiles read it: its packed weights and how many of the two
// there are (the last pair of an odd count has one).
struct ColumnPair {
    const uint16_t* w0;
    const uint16_t* w1;
    int nv;
};

// One thread's share of the pairs over every row, run by run from `queue`: `pair(i)` names
// pair i's blocks, `emit(i, r0, rows, nv, acc)` writes what rows r0 .. r0 + rows make of
// its sums (acc [32][16 nv] fp32). Configures the thread's tiles and releases them.
template <class Tiles, class Pair, class Emit>
CADENCE_AMX_BF16_TARGET bool pairs_over_rows(const uint16_t* x, int64_t xs, int64_t m, int64_t k,
                                             WorkQueue& queue, Pair pair, Emit emit) {
    const int64_t k32 = (k + K_STEP - 1) / K_STEP;
    static thread_local std::vector<uint16_t> strip;
    // the last row group's source, copied (where it must be) once for every pair
    const int64_t last0 = (m - 1) / (2 * ROWS) * (2 * ROWS);
    const int last_na = m - last0 > ROWS ? 2 : 1;
    const RowSource last = rows_at(x, xs, m, k, k32, last0, last_na, strip);
    alignas(64) float acc[2 * ROWS * 2 * COLS];
    Tiles::configure(tile_config());
    int64_t p0 = 0, p1 = 0;
    while (queue.claim(p0, p1)) {
        for (int64_t i = p0; i < p1; ++i) {
            const ColumnPair c = pair(i);
            for (int64_t r0 = 0; r0 < m; r0 += 2 * ROWS) {
                const int na = m - r0 > ROWS ? 2 : 1;
                const RowSource a = r0 == last0 ? last : RowSource{x + r0 * xs, xs};
                if (r0 == 0) row_group<Tiles, true>(na, c.nv, a, c.w0, c.w1, k32, acc);
                else row_group<Tiles, false>(na, c.nv, a, c.w0, c.w1, k32, acc);
                emit(i, r0, std::min<int64_t>(2 * ROWS, m - r0), c.nv, acc);
            }
        }
    }
    const bool ok = Tiles::ok();
    Tiles::release();
    return ok;
}

// `units` pairs run over the call's threads from one WorkQueue (work_queue.h), each thread
// running `run(x, xs, k, queue)` with x's k made a multiple of 32 (copied zero-padded once
// for every thread where it is not); TILE_FAULT if a thread's tiles faulted.
template <class Run>
int on_threads(const uint16_t* x, int64_t xs, int64_t m, int64_t k, int64_t units,
               int num_threads, Run run) {
    std::vector<uint16_t> padded;
    if (k % K_STEP != 0) {
        const int64_t width = (k + K_STEP - 1) / K_STEP * K_STEP;
        padded.assign(m * width, 0);
        for (int64_t r = 0; r < m; ++r)
            std::memcpy(padded.data() + r * width, x + r * xs, k * sizeof(uint16_t));
        x = padded.data(), xs = width, k = width;
    }
    const int threads =
        static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, units)));
    WorkQueue queue(units, threads);
    std::atomic<bool> faulted{false};
#pragma omp parallel num_threads(threads)
    {
        if (!run(x, xs, k, queue)) faulted = true;
    }
    return faulted ? TILE_FAULT : OK;
}

// y = x @ W.T: pair i is column blocks 2i and 2i + 1 (a thread's run of whole pairs, so only
// the last run can end on a lone block), each weight tile streamed once per call while a
// thread passes every row group over it.
template <class Tiles>
int product(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* w, int64_t n,
            uint16_t* y, int64_t ys, int num_threads) {
    const int64_t blocks = (n + COLS - 1) / COLS, k32 = (k + K_STEP - 1) / K_STEP;
    auto pair = [=](int64_t i) {
        const int nv = static_cast<int>(std::min<int64_t>(2, blocks - 2 * i));
        const uint16_t* w0 = w + 2 * i * k32 * TILE_ELEMS;
        return ColumnPair{w0, w0 + (nv == 2 ? k32 * TILE_ELEMS : 0), nv};
    };
    auto emit = [=](int64_t i, int64_t r0, int64_t rows, int nv, const float* acc) {
        const int64_t col0 = 2 * i * COLS, cols = std::min<int64_t>(nv * COLS, n - col0);
        for (int64_t r = 0; r < rows; ++r)
            store_row(acc + r * nv * COLS, cols, y + (r0 + r) * ys + col0);
    };
    return on_threads(x, xs, m, k, (blocks + 1) / 2, num_threads,
                      [&](const uint16_t* xp, int64_t xps, int64_t kp, WorkQueue& queue) {
                          return pairs_over_rows<Tiles>(xp, xps, m, kp, queue, pair, emit);
                      });
}

// The fused gate/up product's SwiGLU, y [m, inter]: pair j is gate block j (packed block j)
// and up block j (block inter / 16 + j); each sum rounded to bfloat16 as store_row rounds
// it, then silu_mul's arithmetic (fast_exp.h): the bits of the product followed by
// cadence_silu_mul, without writing the gate/up rows out and reading them back.
template <class Tiles>
int swiglu_product(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* w,
                   int64_t inter, uint16_t* y, int64_t ys, int num_threads) {
    const int64_t half = inter / COLS, k32 = (k + K_STEP - 1) / K_STEP;
    auto pair = [=](int64_t j) {
        return ColumnPair{w + j * k32 * TILE_ELEMS, w + (half + j) * k32 * TILE_ELEMS, 2};
    };
    auto emit = [=](int64_t j, int64_t r0, int64_t rows, int /*nv*/, const float* acc) {
        for (int64_t r = 0; r < rows; ++r) {
            const float* sums = acc + r * 2 * COLS;
            const __m512 act = silu_mul16(as_stored(sums), as_stored(sums + COLS));
            bf16x16_store(y + (r0 + r) * ys + j * COLS, act);
        }
    };
    return on_threads(x, xs, m, k, half, num_threads,
                      [&](const uint16_t* xp, int64_t xps, int64_t kp, WorkQueue& queue) {
                          return pairs_over_rows<Tiles>(xp, xps, m, kp, queue, pair, emit);
                      });
}

// An entry point's checks of `tiles` and the grant, then `run` on the tiles it names (an
// instance of HardwareTiles or EmulatedTiles; `empty`: nothing to multiply).
template <class Run>
int with_tiles(int tiles, bool empty, Run run) {
    if (tiles != TILES_AMX && tiles != TILES_EMULATED) return BAD_TILES;
    if (tiles == TILES_AMX && !amx_bf16_granted) return NO_AMX;
    if (empty) return OK;
    return tiles == TILES_AMX ? run(cadence_amx::HardwareTiles{})
                              : run(cadence_amx::EmulatedTiles{});
}
#endif  // CADENCE_BF16_AMX

}  // namespace

extern "C" {

int cadence_amx_bf16_request(void) {
#ifdef CADENCE_BF16_AMX
    static const bool granted = cadence_amx::request_permission(cadence_amx::AMX_BF16);
    amx_bf16_granted = granted;
    return granted ? 1 : 0;
#else
    return 0;
#endif
}

int cadence_bf16_matmul_tiles(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k,
                              const uint16_t* packed, int64_t n, uint16_t* y, int64_t y_stride,
                              int num_threads, int tiles) {
#ifdef CADENCE_BF16_AMX
    return with_tiles(tiles, m == 0 || n == 0, [&](auto t) {
        return product<decltype(t)>(x, x_stride, m, k, packed, n, y, y_stride, num_threads);
    });
#else
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)n, (void)y, (void)y_stride;
    (void)num_threads, (void)tiles;
    return cadence_kernels::NO_AMX_KERNEL;
#endif
}

int cadence_bf16_matmul_tiles_swiglu(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k,
                                     const uint16_t* packed, int64_t inter, uint16_t* y,
                                     int64_t y_stride, int num_threads, int tiles) {
#ifdef CADENCE_BF16_AMX
    return with_tiles(tiles, m == 0 || inter == 0, [&](auto t) {
        return swiglu_product<decltype(t)>(x, x_stride, m, k, packed, inter, y, y_stride,
                                           num_threads);
    });
#else
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)inter, (void)y;
    (void)y_stride, (void)num_threads, (void)tiles;
    return cadence_kernels::NO_AMX_KERNEL;
#endif
}

}  // extern "C"
