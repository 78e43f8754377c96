// Products with quantized weights that compute on integers: y = x @ W.T with W int4 per
// group (w = q * scale + zero', q 0..15) or int8 per output channel (w = q * scale), and
// the activations x quantized as they come in to int8 in blocks of 32 columns (one float
// scale per row and block: d = amax / 127, q = round(x / d)), as llama.cpp multiplies its
// Q4/Q8 weights. Each 32-column block's integer dot products are exact in int32; they are
// scaled and summed in float32.
//
// Why: torch's weight-only kernels dequantize each weight to bfloat16 and lose to oneDNN's
// bfloat16 GEMM from a handful of rows on, so a quantized model decoded 32 sequences at
// bfloat16's speed. With VNNI's vpdpbusd (64 u8 x s8 products into 16 int32 sums per
// instruction, twice vdpbf16ps' 32) and a quarter (int4) or half (int8) of bfloat16's
// weight bytes, the product is faster than bfloat16's at every row count measured
// (docs/quantization.md).
//
// Weight layouts (cadence/quant/cpu_gemm.py packs them; output channels in blocks of 16,
// the last padded with zero weights; input columns in blocks of 32):
//   int4: packed [n16][k32][4][16][4] uint8: byte (j, c, i) of block (nb, b) holds column
//         16 nb + c's q at input b*32 + 4j + i in its low nibble and at b*32 + 16 + 4j + i
//         in its high one; sz [n16][k32][2][16] float32: scale, then zero' (= zero - 8 *
//         scale of cadence/quant/formats.Int4Weight), for the block's 16 columns.
//   int8: packed [n16][k32][8][16][4] uint8: q + 128 of column 16 nb + c at input
//         b*32 + 4j + i; sz [n16 * 16] float32: the column scales.
// (vpdpbusd multiplies unsigned by signed bytes: int4's q is already unsigned; int8's is
// stored + 128 and each row's 128 * sum of its quantized activations taken off at the end.)
//
// The AVX-512 VNNI build runs the vector tiles of quant_tiles_avx512.h (4 rows x 48
// columns), the AVX2 build those of quant_tiles_avx2.h (4 rows x 32 columns, vpmaddubsw and
// vpmaddwd for vpdpbusd); the others (scalar, and AVX-512 without VNNI) run the same
// arithmetic in portable C++ (the tests hold all of them to one reference). Each thread takes one run of column blocks; a tile's weights stay in
// cache for every row tile, and the first row tile asks for the next tile's weights.
//
// The VNNI build also has AMX-INT8 tiles (quant_amx.h; cadence_quant_matmul_tiles), in the
// hardware's instructions or their emulation, bitwise equal to its VNNI product.

#include "cpu_elements.h"
#include "cpu_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "quant_rows.h"
#include "work_queue.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "quant_tiles_avx512.h"
#define CADENCE_QUANT_VECTOR_TILES 1
#include "quant_amx.h"
#define CADENCE_QUANT_AMX 1
// x86-64-v4 has AVX2 too: the avx512 build (no VNNI) keeps the portable tiles
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include "quant_tiles_avx2.h"
#define CADENCE_QUANT_VECTOR_TILES 1
#endif

namespace {

using namespace cadence_kernels;
using namespace cadence_quant;

inline float load_f32(const void* x, int64_t i, int dtype) {
    return dtype == BF16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[i])
                         : static_cast<const float*>(x)[i];
}

// Columns col0 .. col0 + 31 of a row of x (zero past k) quantized into q.
[[maybe_unused]] BlockQuantized quantize_block_portable(const void* x, int64_t base, int64_t col0,
                                                        int64_t k, int dtype, int8_t* q) {
    float v[BLOCK];
    float amax = 0.0f;
    for (int64_t i = 0; i < BLOCK; ++i) {
        v[i] = col0 + i < k ? load_f32(x, base + col0 + i, dtype) : 0.0f;
        amax = std::max(amax, std::fabs(v[i]));
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int64_t i = 0; i < BLOCK; ++i) {
        const int32_t qi = static_cast<int32_t>(std::nearbyint(v[i] * inv));
        q[i] = static_cast<int8_t>(qi);
        sum += qi;
    }
    return {amax / 127.0f, sum};
}

// Row r of x (k columns, stride x_stride elements) into out's row r.
void quantize_row(const void* x, int64_t x_stride, int64_t r, int64_t k, int dtype,
                  QuantizedRows& out) {
    const int64_t base = r * x_stride;
    int8_t* q = out.q.data() + r * out.k32 * BLOCK;
    float correction = 0.0f;
    for (int64_t b = 0; b < out.k32; ++b) {
#ifdef CADENCE_QUANT_VECTOR_QUANTIZE
        const BlockQuantized block = quantize_block_vector(x, base, b * BLOCK, k, dtype, q + b * BLOCK);
#else
        const BlockQuantized block =
            quantize_block_portable(x, base, b * BLOCK, k, dtype, q + b * BLOCK);
#endif
        const float dsum = block.d * static_cast<float>(block.sum);
        out.d[r * out.k32 + b] = block.d;
        out.dsum[r * out.k32 + b] = dsum;
        correction += dsum;
    }
    out.correction[r] = 128.0f * correction;
}

QuantizedRows& quantize_rows(const void* x, int64_t x_stride, int64_t m, int64_t k, int dtype,
                             int num_threads) {
    static thread_local QuantizedRows rows;  // reused: one step's products share the sizes
    rows.k32 = (k + BLOCK - 1) / BLOCK;
    rows.q.resize(m * rows.k32 * BLOCK);
    rows.d.resize(m * rows.k32);
    rows.dsum.resize(m * rows.k32);
    rows.correction.resize(m);
    QuantizedRows* shared = &rows;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; ++r) quantize_row(x, x_stride, r, k, dtype, *shared);
    return rows;
}

inline void store_row(void* y, int64_t y_stride, int64_t r, int64_t col0, int64_t cols,
                      const float* v, int dtype) {
    if (dtype == BF16) {
        uint16_t* dst = static_cast<uint16_t*>(y) + r * y_stride + col0;
        for (int64_t c = 0; c < cols; ++c) dst[c] = f32_to_bf16(v[c]);
    } else {
        float* dst = static_cast<float*>(y) + r * y_stride + col0;
        std::memcpy(dst, v, cols * sizeof(float));
    }
}

// ---- portable tiles ------------------------------------------------------------------------

// acc[r][c] for rows r0.. of one 16-column block, int4.
[[maybe_unused]] void int4_tile_portable(const uint8_t* w, const float* sz, const QuantizedRows& a, int64_t r0,
                        int rows, float acc[MAX_ROWS][COLS]) {
    for (int r = 0; r < rows; ++r)
        for (int64_t c = 0; c < COLS; ++c) acc[r][c] = 0.0f;
    for (int64_t b = 0; b < a.k32; ++b) {
        const uint8_t* wb = w + b * 256;
        const float* s = sz + b * 2 * COLS;
        for (int r = 0; r < rows; ++r) {
            const int8_t* xq = a.q.data() + (r0 + r) * a.k32 * BLOCK + b * BLOCK;
            const float d = a.d[(r0 + r) * a.k32 + b], dsum = a.dsum[(r0 + r) * a.k32 + b];
            for (int64_t c = 0; c < COLS; ++c) {
                int32_t dot = 0;
                for (int64_t j = 0; j < 4; ++j)
                    for (int64_t i = 0; i < 4; ++i) {
                        const uint8_t byte = wb[j * 64 + c * 4 + i];
                        dot += (byte & 0x0F) * xq[4 * j + i] + (byte >> 4) * xq[16 + 4 * j + i];
                    }
                acc[r][c] += static_cast<float>(dot) * d * s[c];
                acc[r][c] += s[COLS + c] * dsum;
            }
        }
    }
}

[[maybe_unused]] void int8_tile_portable(const uint8_t* w, const float* scale, const QuantizedRows& a,
                        int64_t r0, int rows, float acc[MAX_ROWS][COLS]) {
    for (int r = 0; r < rows; ++r)
        for (int64_t c = 0; c < COLS; ++c) acc[r][c] = 0.0f;
    for (int64_t b = 0; b < a.k32; ++b) {
        const uint8_t* wb = w + b * 512;
        for (int r = 0; r < rows; ++r) {
            const int8_t* xq = a.q.data() + (r0 + r) * a.k32 * BLOCK + b * BLOCK;
            const float d = a.d[(r0 + r) * a.k32 + b];
            for (int64_t c = 0; c < COLS; ++c) {
                int32_t dot = 0;
                for (int64_t j = 0; j < 8; ++j)
                    for (int64_t i = 0; i < 4; ++i) dot += wb[j * 64 + c * 4 + i] * xq[4 * j + i];
                acc[r][c] += static_cast<float>(dot) * d;
            }
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int64_t c = 0; c < COLS; ++c)
            acc[r][c] = (acc[r][c] - a.correction[r0 + r]) * scale[c];
}

// int8 in blocks of 32: acc += (dot * d - 128 * d * sum(q)) * scale of the block.
[[maybe_unused]] void int8_blocks_tile_portable(const uint8_t* w, const float* sz,
                                                const QuantizedRows& a, int64_t r0, int rows,
                                                float acc[MAX_ROWS][COLS]) {
    for (int r = 0; r < rows; ++r)
        for (int64_t c = 0; c < COLS; ++c) acc[r][c] = 0.0f;
    for (int64_t b = 0; b < a.k32; ++b) {
        const uint8_t* wb = w + b * 512;
        const float* s = sz + b * COLS;
        for (int r = 0; r < rows; ++r) {
            const int8_t* xq = a.q.data() + (r0 + r) * a.k32 * BLOCK + b * BLOCK;
            const float d = a.d[(r0 + r) * a.k32 + b];
            const float shift = -128.0f * a.dsum[(r0 + r) * a.k32 + b];
            for (int64_t c = 0; c < COLS; ++c) {
                int32_t dot = 0;
                for (int64_t j = 0; j < 8; ++j)
                    for (int64_t i = 0; i < 4; ++i) dot += wb[j * 64 + c * 4 + i] * xq[4 * j + i];
                acc[r][c] += (static_cast<float>(dot) * d + shift) * s[c];
            }
        }
    }
}

[[maybe_unused]] void portable_tile(int format, const uint8_t* w, const float* s,
                                    const QuantizedRows& a, int64_t r0, int rows,
                                    float tile[MAX_ROWS][COLS]) {
    if (format == QUANT_INT4) int4_tile_portable(w, s, a, r0, rows, tile);
    else if (format == QUANT_INT8) int8_tile_portable(w, s, a, r0, rows, tile);
    else int8_blocks_tile_portable(w, s, a, r0, rows, tile);
}

// Per format, per 32-column block: weight bytes of a 16-channel block, and scale floats.
inline int64_t block_weight_bytes(int format) { return format == QUANT_INT4 ? 256 : 512; }
inline int64_t block_scale_floats(int format) {
    return format == QUANT_INT4 ? 2 * COLS : format == QUANT_INT8_BLOCKS ? COLS : 0;
}

#ifndef CADENCE_QUANT_VECTOR_TILES
constexpr int TILE_ROWS = MAX_ROWS;
constexpr int TILE_BLOCKS = 1;
#endif

// Column blocks [nb0, nb1) of every row: tiles of TILE_BLOCKS blocks x TILE_ROWS rows, the
// tile's weights reused by every row tile while they are in cache.
void column_blocks(int format, const uint8_t* packed, const float* sz, int64_t nb0, int64_t nb1,
                   const QuantizedRows& a, int64_t m, int64_t n, void* y, int64_t y_stride,
                   int dtype) {
    const int64_t block_bytes = a.k32 * block_weight_bytes(format);
    // int8's per-channel scales are COLS a column block, the others' per 32-column block
    const int64_t block_scales = format == QUANT_INT8 ? COLS : a.k32 * block_scale_floats(format);
    float acc[MAX_ROWS * TILE_BLOCKS * COLS];
    for (int64_t nb = nb0; nb < nb1; nb += TILE_BLOCKS) {
        const int nv = static_cast<int>(std::min<int64_t>(TILE_BLOCKS, nb1 - nb));
        const uint8_t* w = packed + nb * block_bytes;
        const float* s = sz + nb * block_scales;
        const int64_t col0 = nb * COLS, cols = std::min(nv * COLS, n - col0);
        for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS) {
            const int rows = static_cast<int>(std::min<int64_t>(TILE_ROWS, m - r0));
#ifdef CADENCE_QUANT_VECTOR_TILES
            Prefetch next;
            if (r0 == 0 && nb + TILE_BLOCKS < nb1) {  // the first row tile asks for the next panel
                next = {w + TILE_BLOCKS * block_bytes, s + TILE_BLOCKS * block_scales, block_bytes,
                        block_weight_bytes(format), block_scales,
                        block_scale_floats(format) * static_cast<int64_t>(sizeof(float)),
                        static_cast<int>(std::min<int64_t>(TILE_BLOCKS, nb1 - nb - TILE_BLOCKS))};
            }
            vector_tile(rows, nv, format, w, s, a, r0, next, acc, nv * COLS);
#else
            float tile[MAX_ROWS][COLS];
            portable_tile(format, w, s, a, r0, rows, tile);
            for (int r = 0; r < rows; ++r) std::memcpy(acc + r * COLS, tile[r], sizeof(tile[r]));
#endif
            for (int r = 0; r < rows; ++r)
                store_row(y, y_stride, r0 + r, col0, cols, acc + r * nv * COLS, dtype);
        }
    }
}

#ifdef CADENCE_QUANT_AMX
std::atomic<bool> amx_granted{false};  // cadence_amx_request's answer in this process

// AMX's tiles take 16 rows: rows m .. the next multiple of 16 made zero rows (scales too),
// computed and never stored.
void pad_rows(QuantizedRows& a, int64_t m) {
    const int64_t padded = (m + amx::TILE_ROWS - 1) / amx::TILE_ROWS * amx::TILE_ROWS;
    a.q.resize(padded * a.k32 * BLOCK);
    std::fill(a.q.begin() + m * a.k32 * BLOCK, a.q.end(), 0);
    for (std::vector<float>* v : {&a.d, &a.dsum}) {
        v->resize(padded * a.k32);
        std::fill(v->begin() + m * a.k32, v->end(), 0.0f);
    }
    a.correction.resize(padded);
    std::fill(a.correction.begin() + m, a.correction.end(), 0.0f);
}

// cadence_quant_matmul's product on AMX tiles: the same quantized rows, the same queue of
// column blocks, each run configuring its thread's tiles.
template <class Tiles>
int amx_matmul(const void* x, int64_t x_stride, int64_t m, int64_t k, const uint8_t* w,
               const float* scales, int64_t n, int format, void* y, int64_t y_stride, int dtype,
               int num_threads) {
    QuantizedRows& a = quantize_rows(x, x_stride, m, k, dtype, num_threads);
    pad_rows(a, m);
    const int64_t blocks = (n + COLS - 1) / COLS;
    const int threads =
        static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
    const auto store = [=](int64_t r, int64_t col0, int64_t cols, const float* v) {
        store_row(y, y_stride, r, col0, cols, v, dtype);
    };
    WorkQueue queue(blocks, threads, amx::GROUP_TILES);
    std::atomic<bool> faulted{false};
#pragma omp parallel num_threads(threads)
    {
        int64_t b0 = 0, b1 = 0;
        while (queue.claim(b0, b1))
            if (!amx::column_blocks<Tiles>(format, w, scales, b0, b1, a, m, n, store))
                faulted = true;
    }
    return faulted ? TILE_FAULT : OK;
}
#endif  // CADENCE_QUANT_AMX

}  // namespace

extern "C" {

int cadence_quant_matmul(const void* x, int64_t x_stride, int64_t m, int64_t k,
                         const void* packed, const float* scales, int64_t n, int format,
                         void* y, int64_t y_stride, int dtype, int num_threads) {
    if ((dtype != F32 && dtype != BF16) ||
        (format != QUANT_INT4 && format != QUANT_INT8 && format != QUANT_INT8_BLOCKS))
        return BAD_DTYPE;
    if (m == 0 || n == 0) return OK;
    const QuantizedRows& a = quantize_rows(x, x_stride, m, k, dtype, num_threads);
    const int64_t blocks = (n + COLS - 1) / COLS;
    const uint8_t* w = static_cast<const uint8_t*>(packed);
    // runs of column blocks claimed from a queue (work_queue.h; each run's weights stream once)
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
    WorkQueue queue(blocks, threads, TILE_BLOCKS);
#pragma omp parallel num_threads(threads)
    {
        int64_t b0 = 0, b1 = 0;
        while (queue.claim(b0, b1))
            column_blocks(format, w, scales, b0, b1, a, m, n, y, y_stride, dtype);
    }
    return OK;
}

int cadence_amx_request(void) {
#ifdef CADENCE_QUANT_AMX
    static const bool granted = cadence_amx::request_permission();  // once, thread-safe
    amx_granted = granted;
    return granted ? 1 : 0;
#else
    return 0;
#endif
}

int cadence_quant_matmul_tiles(const void* x, int64_t x_stride, int64_t m, int64_t k,
                               const void* packed, const float* scales, int64_t n, int format,
                               void* y, int64_t y_stride, int dtype, int num_threads,
                               int tiles) {
    if ((dtype != F32 && dtype != BF16) ||
        (format != QUANT_INT4 && format != QUANT_INT8 && format != QUANT_INT8_BLOCKS))
        return BAD_DTYPE;
    if (tiles != TILES_AMX && tiles != TILES_EMULATED) return BAD_TILES;
#ifdef CADENCE_QUANT_AMX
    if (tiles == TILES_AMX && !amx_granted) return NO_AMX;
    if (m == 0 || n == 0) return OK;
    const uint8_t* w = static_cast<const uint8_t*>(packed);
    return tiles == TILES_AMX
               ? amx_matmul<cadence_amx::HardwareTiles>(x, x_stride, m, k, w, scales, n, format,
                                                        y, y_stride, dtype, num_threads)
               : amx_matmul<cadence_amx::EmulatedTiles>(x, x_stride, m, k, w, scales, n, format,
                                                        y, y_stride, dtype, num_threads);
#else
    (void)x, (void)x_stride, (void)m, (void)k, (void)packed, (void)scales, (void)n, (void)y;
    (void)y_stride, (void)num_threads;
    return NO_AMX_KERNEL;
#endif
}

}  // extern "C"
