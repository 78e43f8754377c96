// The pieces quant_kernels.cpp and its vector tiles (quant_tiles_*.h) share: the packed
// layouts' block sizes, a call's quantized activations, and the rows a tile reads.

#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cadence_quant {

constexpr int64_t BLOCK = 32;  // input columns per activation block (and int4 group step)
constexpr int64_t COLS = 16;   // output channels per packed block
constexpr int MAX_ROWS = 8;    // rows per tile

// Every element of a (nested) array of a tile's registers set to v: the tiles' sums and
// accumulators start at zero.
template <typename T>
inline void set_all(T& x, const T& v) {
    x = v;
}
template <typename T, size_t N, typename V>
inline void set_all(T (&a)[N], const V& v) {
    for (auto& e : a) set_all(e, v);
}

// A block of 32 activations quantized: its scale d = amax / 127, and the sum of its q.
struct BlockQuantized {
    float d;
    int32_t sum;
};

// A call's activations quantized, row by row: q [rows, k32 * 32] int8, and per row and block
// its scale d and d * (sum of its q) (int4's zero' multiplies the block's activation sum).
struct QuantizedRows {
    std::vector<int8_t> q;
    std::vector<float> d, dsum;
    std::vector<float> correction;  // per row: 128 * sum over blocks of d * sum(q) (int8)
    int64_t k32 = 0;
};

// Asks for block b of the next panel (NV column blocks of `block_bytes` weight bytes and
// `block_floats` scales each) while this one computes: the panel streams from memory
// while the previous one's dot products run (the hardware prefetchers alone left a
// 32-row product waiting on memory for a third of its time).
struct Prefetch {
    const uint8_t* w = nullptr;  // null: nothing to prefetch
    const float* s = nullptr;
    int64_t w_stride = 0, w_bytes = 0, s_stride = 0, s_bytes = 0;  // per column block
    int nv = 0;
    void block(int64_t b) const {
        if (!w) return;
        for (int v = 0; v < nv; ++v) {
            const char* wp = reinterpret_cast<const char*>(w + v * w_stride + b * w_bytes);
            for (int64_t i = 0; i < w_bytes; i += 64) __builtin_prefetch(wp + i, 0, 2);
            const char* sp = reinterpret_cast<const char*>(s + v * s_stride) + b * s_bytes;
            for (int64_t i = 0; i < s_bytes; i += 64) __builtin_prefetch(sp + i, 0, 2);
        }
    }
};

// Rows' pointers into the quantized activations, for a tile starting at row r0.
template <int ROWS>
struct TileRows {
    const int8_t* q[ROWS];
    const float* d[ROWS];
    const float* dsum[ROWS];
    TileRows(const QuantizedRows& a, int64_t r0) {
        for (int r = 0; r < ROWS; ++r) {
            q[r] = a.q.data() + (r0 + r) * a.k32 * BLOCK;
            d[r] = a.d.data() + (r0 + r) * a.k32;
            dsum[r] = a.dsum.data() + (r0 + r) * a.k32;
        }
    }
};

}  // namespace cadence_quant
