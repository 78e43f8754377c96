// Decode attention over an int8 KV cache on AMX-INT8 tiles: decode_rows_int8's arithmetic
// (attention_int8_avx512.h), bit for bit, with its two integer products on tiles. Every
// float operation (the query's and the probabilities' int16 scales, the scores' scaling,
// the softmax, the value sums' rescale) is the VNNI kernel's own function or the same
// intrinsics in the same order; only the int32 sums are found another way, and they are
// exact either way. So the tiles change no answer, and batch invariance's contract (a
// prompt token's attention is the decode kernel's) holds whichever kernel serves.
//
// AMX multiplies bytes, the VNNI kernel int16 (the query and the probabilities, per head
// by amax / 32767): each int16 x = 256 hi + lo (hi = x >> 8 signed, lo = x & 255 unsigned)
// makes one product two, sum(x k) = 256 sum(hi k) + sum(lo k), each exact in int32 (hi's
// sums over 256 positions or 256 dimensions of 128 x 128: under 2^23).
// - Scores: C[query head][key] = A (the heads' query bytes, [16][64 dims]) x B (16 keys'
//   bytes, VNNI-transposed: row k holds each key's dimensions 4k..4k+3): tdpbusd for lo,
//   tdpbssd for hi. The query heads of every row of the call and of one KV head share each
//   block's transposed keys (prefill's rows of a prompt chunk: up to AMX_GROUP_ROWS).
// - Values: C[query head][dimension] = A (probabilities' bytes, [16][64 positions]) x B
//   (the chunk's value rows, 4 positions' bytes interleaved per dimension), both halves
//   by tdpbusd (probabilities are >= 0). The interleave (unpack epi8, then epi16, within
//   each 128-bit lane) leaves B tile j's column n holding dimension
//   64 (j / 4) + 16 (n / 4) + 4 (j % 4) + n % 4: amx_value_index maps it back at the end.
//
// Tiles (one configuration a call, released at its end): 0, 1 the A halves (lo, hi) of
// up to 16 query heads; 2 the B tile; 3, 4 the C halves. A call's query heads past a
// multiple of 16 are zero rows of the last A tile, computed and never read.

#pragma once

#include "amx_tiles.h"
#include "attention_int8_avx512.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

namespace {

#ifdef CADENCE_AVX512_BF16

constexpr int AMX_HEAD_TILE = 16;  // query heads per A tile (its rows)
constexpr int AMX_K = 64;          // bytes a tile row multiplies (dimensions or positions)
constexpr int AMX_GROUP_ROWS = 16;  // query rows a call takes (INT8_GROUP_ROWS' counterpart)
constexpr int AMX_STEPS = INT8_CHUNK / AMX_K;  // 64-position steps of a chunk's values
constexpr int T_ALO = 0, T_AHI = 1, T_B = 2, T_CLO = 3, T_CHI = 4;

// Set when the emulated tiles ran an instruction the hardware refuses (a kernel bug): the
// entry point's status says so.
inline std::atomic<bool> amx_attention_fault{false};

// Query-head tiles of a call: `rows` rows of G query heads each, 16 heads a tile.
inline int head_tiles(int rows, int G) { return (rows * G + AMX_HEAD_TILE - 1) / AMX_HEAD_TILE; }

// What a call's rows share at the front of its scratch, in floats: the chunk's blocks'
// first slots, the transposed keys [D / 64][16][64], the C halves [2][16][16] int32, the
// query bytes [2][KVH][tiles * 16][D], the transposed values [D / 16][AMX_STEPS][16][64],
// the probability bytes [2][tiles * 16][INT8_CHUNK]. Value rows past a chunk's last
// block are stale in the B tiles: their probabilities are zero.
struct AmxShared {
    int64_t* bases;
    uint8_t* keys;
    int32_t* c;  // [2][16][16]: lo, then hi
    uint8_t* q;  // [2][KVH][tiles * 16][D]: lo, then hi
    uint8_t* values;
    uint8_t* p;  // [2][tiles * 16][INT8_CHUNK]: lo, then hi

    static int64_t floats(int KVH, int D, int tiles) {
        const int64_t bytes = 16 * int64_t{D} + 2 * 16 * 16 * 4 +
                              2 * int64_t{KVH} * tiles * AMX_HEAD_TILE * D +
                              int64_t{D} * INT8_CHUNK + 2 * int64_t{tiles} * AMX_HEAD_TILE * INT8_CHUNK;
        return 2 * INT8_CHUNK + (bytes + 3) / 4;
    }
    AmxShared(float* base, int KVH, int D, int tiles) {
        bases = reinterpret_cast<int64_t*>(base);
        keys = reinterpret_cast<uint8_t*>(base + 2 * INT8_CHUNK);
        c = reinterpret_cast<int32_t*>(keys + 16 * D);
        q = reinterpret_cast<uint8_t*>(c + 2 * 16 * 16);
        values = q + 2 * int64_t{KVH} * tiles * AMX_HEAD_TILE * D;
        p = values + int64_t{D} * INT8_CHUNK;
    }
};

inline int64_t amx_shared_floats(int KVH, int D, int G) {
    return AmxShared::floats(KVH, D, head_tiles(AMX_GROUP_ROWS, G));
}

// Where dimension d of a head sits in the accumulators (the values' B columns, in order).
inline int amx_value_index(int d) {
    const int step = d / AMX_K, e = d % AMX_K;
    const int tile = 4 * step + (e % 16) / 4, column = 4 * (e / 16) + e % 4;
    return 16 * tile + column;
}

// int16 x[0, n) (n a multiple of 32) as its bytes: lo = x & 255, hi = x >> 8 (signed).
inline void split_i16(const int16_t* x, int n, uint8_t* lo, uint8_t* hi) {
    for (int i = 0; i < n; i += 32) {
        const __m512i v = _mm512_loadu_si512(x + i);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), _mm512_cvtepi16_epi8(v));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i),
                            _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
    }
}

// 16 rows of 16 int32 (row_stride bytes apart), transposed into dst (16 x 64 bytes): dst
// row k holds dword k of each row, as a B tile's row k holds 4 bytes of each column.
inline void transpose16(const uint8_t* rows, int64_t row_stride, uint8_t* dst) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows + i * row_stride);
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // u[4 g + i]: lane L holds rows 4g..4g+3's dword 4L + i
    for (int g = 0; g < 4; ++g) {
        const __m512i* s = t + 4 * g;
        r[4 * g + 0] = _mm512_unpacklo_epi64(s[0], s[2]);
        r[4 * g + 1] = _mm512_unpackhi_epi64(s[0], s[2]);
        r[4 * g + 2] = _mm512_unpacklo_epi64(s[1], s[3]);
        r[4 * g + 3] = _mm512_unpackhi_epi64(s[1], s[3]);
    }
    for (int i = 0; i < 4; ++i) {
        const __m512i v0 = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xEE);
        const __m512i w0 = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x44);
        const __m512i w1 = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xEE);
        _mm512_storeu_si512(dst + (0 + i) * 64, _mm512_shuffle_i32x4(v0, w0, 0x88));
        _mm512_storeu_si512(dst + (4 + i) * 64, _mm512_shuffle_i32x4(v0, w0, 0xDD));
        _mm512_storeu_si512(dst + (8 + i) * 64, _mm512_shuffle_i32x4(v1, w1, 0x88));
        _mm512_storeu_si512(dst + (12 + i) * 64, _mm512_shuffle_i32x4(v1, w1, 0xDD));
    }
}

// A block's value rows of one KV head (rows `row_stride` bytes apart) into the chunk's B
// tiles: position `at` of the chunk (a multiple of 16) onward, 16 positions a group.
template <int D>
inline void interleave_values(const int8_t* rows, int64_t row_stride, int block_size, int at,
                              uint8_t* values) {
    for (int t = 0; t < block_size; t += 4) {
        const int pos = at + t, step = pos / AMX_K, row = (pos % AMX_K) / 4;
        for (int c = 0; c < D / AMX_K; ++c) {
            const int8_t* r0 = rows + t * row_stride + c * AMX_K;
            const __m512i x0 = _mm512_loadu_si512(r0), x1 = _mm512_loadu_si512(r0 + row_stride);
            const __m512i x2 = _mm512_loadu_si512(r0 + 2 * row_stride);
            const __m512i x3 = _mm512_loadu_si512(r0 + 3 * row_stride);
            const __m512i lo01 = _mm512_unpacklo_epi8(x0, x1), hi01 = _mm512_unpackhi_epi8(x0, x1);
            const __m512i lo23 = _mm512_unpacklo_epi8(x2, x3), hi23 = _mm512_unpackhi_epi8(x2, x3);
            const __m512i quads[4] = {
                _mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
            for (int j = 0; j < 4; ++j) {
                uint8_t* tile = values + ((4 * c + j) * AMX_STEPS + step) * 1024;
                _mm512_storeu_si512(tile + row * 64, quads[j]);
            }
        }
    }
}

// Row m of the stored C halves (16 int32 each) as one sum: 256 hi + lo, exact in int32.
inline __m512i c_row(const int32_t* c_lo, const int32_t* c_hi, int m) {
    return _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(c_hi + 16 * m), 8),
                            _mm512_loadu_si512(c_lo + 16 * m));
}

// decode_rows_int8 on tiles: the same arguments, the same result bit for bit, up to
// AMX_GROUP_ROWS rows (the scratch: amx_shared_floats, then Int8Scratch::floats per row).
template <class Tiles, int QT, int D>
CADENCE_AMX_TARGET void decode_rows_int8_amx(const void* q, void* out, const void* k_cache, const void* v_cache,
                          const float* k_scale, const float* v_scale, const int64_t* table,
                          const int64_t* context_lens, int64_t seq0, int rows, int num_heads,
                          int num_kv_heads, int block_size, float scale, int64_t window,
                          float* scratch) {
    static_assert(D % AMX_K == 0, "the tiles take 64 dimensions a step");
    constexpr int KSTEPS = D / AMX_K, VTILES = D / 16;
    const int G = num_heads / num_kv_heads, M = rows * G, tiles = head_tiles(rows, G);
    const int MP = tiles * AMX_HEAD_TILE;  // query heads, padded to whole tiles
    const int read = M > AMX_HEAD_TILE ? MP : M;  // the A rows the tiles load
    AmxShared sh(scratch, num_kv_heads, D, head_tiles(AMX_GROUP_ROWS, G));
    float* row_scratch = scratch + amx_shared_floats(num_kv_heads, D, G);
    const int64_t per_row = Int8Scratch::floats(num_heads, num_kv_heads, D);
    Int8Scratch ws[AMX_GROUP_ROWS];
    int64_t num_blocks[AMX_GROUP_ROWS];
    int64_t num_blocks_all = 0;
    uint8_t* q_lo = sh.q;
    uint8_t* q_hi = sh.q + int64_t{num_kv_heads} * MP * D;
    for (int kh = 0; kh < num_kv_heads; ++kh) {  // the padding heads: zero
        std::memset(q_lo + (int64_t{kh} * MP + M) * D, 0, int64_t{read - M} * D);
        std::memset(q_hi + (int64_t{kh} * MP + M) * D, 0, int64_t{read - M} * D);
    }
    for (int r = 0; r < rows; ++r) {
        Int8Scratch& w = ws[r] = Int8Scratch(row_scratch + r * per_row, num_heads, num_kv_heads, D);
        num_blocks[r] = start_row<QT>(w, q, seq0 + r, num_heads, D, scale, context_lens[r],
                                      block_size);
        for (int h = 0; h < num_heads; ++h) {  // the query heads' bytes, in their A tiles
            const int kh = h / G, at = (kh * MP + r * G + h % G) * D;
            split_i16(w.q16 + h * D, D, q_lo + at, q_hi + at);
        }
        num_blocks_all = std::max(num_blocks_all, num_blocks[r]);
    }
    cadence_amx::TileConfig cfg;
    const int m_rows = std::min(M, AMX_HEAD_TILE);
    cfg.shape(T_ALO, m_rows, AMX_K);
    cfg.shape(T_AHI, m_rows, AMX_K);
    cfg.shape(T_B, 16, 64);
    cfg.shape(T_CLO, m_rows, 64);
    cfg.shape(T_CHI, m_rows, 64);
    Tiles::configure(cfg);
    int32_t* c_lo = sh.c;
    int32_t* c_hi = sh.c + 256;
    const auto* k8 = static_cast<const int8_t*>(k_cache);
    const auto* v8 = static_cast<const int8_t*>(v_cache);
    const int64_t row_stride = static_cast<int64_t>(num_kv_heads) * D;  // bytes
    const int64_t block_bytes = block_size * row_stride;
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, context_lens[0] - window) : 0;
    const int chunk_blocks = INT8_CHUNK / block_size;
    const int64_t first_block = first_key / block_size;
    const __m512i scale_index = scale_gather_index(num_kv_heads);
    uint8_t* p_lo = sh.p;
    uint8_t* p_hi = sh.p + int64_t{MP} * INT8_CHUNK;
    for (int64_t b0 = first_block; b0 < num_blocks_all; b0 += chunk_blocks) {
        const int blocks = static_cast<int>(std::min<int64_t>(chunk_blocks, num_blocks_all - b0));
        // pass 1: every block's scores, block by block (its keys read front to back once)
        for (int i = 0; i < blocks; ++i) {
            const int64_t b = b0 + i;
            sh.bases[i] = table[b] * block_size;
            if (b + PREFETCH_BLOCKS < num_blocks_all) {  // its keys, values (for pass 2), scales
                const int64_t ahead = table[b + PREFETCH_BLOCKS] * block_size;
                prefetch_block(k8 + ahead * row_stride, block_bytes);
                prefetch_block(v8 + ahead * row_stride, block_bytes);
                prefetch_block(k_scale + ahead * num_kv_heads, block_size * num_kv_heads * 4);
                prefetch_block(v_scale + ahead * num_kv_heads, block_size * num_kv_heads * 4);
            }
            const int64_t lo = std::max<int64_t>(0, first_key - b * block_size);
            for (int kh = 0; kh < num_kv_heads; ++kh) {
                for (int r0 = 0; r0 < block_size; r0 += 16) {
                    const int64_t slot0 = sh.bases[i] + r0;
                    __mmask16 seen[AMX_GROUP_ROWS], any = 0;
                    for (int r = 0; r < rows; ++r) {
                        const int64_t hi = std::min<int64_t>(block_size, context_lens[r] - b * block_size);
                        seen[r] = b < num_blocks[r] ? seen_mask(r0, lo, hi) : 0;
                        any |= seen[r];
                    }
                    // the keys' scales, read only where some row sees the key
                    const float* ks_at = k_scale + slot0 * num_kv_heads + kh;
                    const float* vs_at = v_scale + slot0 * num_kv_heads + kh;
                    const __m512 zero = _mm512_setzero_ps();
                    const __m512 ks = _mm512_mask_i32gather_ps(zero, any, scale_index, ks_at, 4);
                    const __m512 vs = _mm512_mask_i32gather_ps(zero, any, scale_index, vs_at, 4);
                    for (int s = 0; s < KSTEPS; ++s)
                        transpose16(reinterpret_cast<const uint8_t*>(k8 + slot0 * row_stride + kh * D) +
                                        s * AMX_K,
                                    row_stride, sh.keys + s * 1024);
                    const int at = i * block_size + r0;
                    for (int r = 0; r < rows; ++r)  // the row's value scales (0 where unseen)
                        if (b < num_blocks[r])
                            _mm512_storeu_ps(ws[r].vsc + kh * INT8_CHUNK + at,
                                             _mm512_maskz_mov_ps(seen[r], vs));
                    for (int tile = 0; tile < tiles; ++tile) {
                        Tiles::template zero<T_CLO>();
                        Tiles::template zero<T_CHI>();
                        const int64_t a_at = (int64_t{kh} * MP + tile * AMX_HEAD_TILE) * D;
                        for (int s = 0; s < KSTEPS; ++s) {
                            Tiles::template load<T_ALO>(q_lo + a_at + s * AMX_K, D);
                            Tiles::template load<T_AHI>(q_hi + a_at + s * AMX_K, D);
                            Tiles::template load<T_B>(sh.keys + s * 1024, 64);
                            Tiles::template dpbusd<T_CLO, T_ALO, T_B>();
                            Tiles::template dpbssd<T_CHI, T_AHI, T_B>();
                        }
                        Tiles::template store<T_CLO>(c_lo, 64);
                        Tiles::template store<T_CHI>(c_hi, 64);
                        const int last = std::min(AMX_HEAD_TILE, M - tile * AMX_HEAD_TILE);
                        for (int m = 0; m < last; ++m) {
                            const int j = tile * AMX_HEAD_TILE + m, r = j / G;
                            if (b >= num_blocks[r]) continue;
                            const int h = kh * G + j % G;
                            const __m512i dot = c_row(c_lo, c_hi, m);
                            const __m512 kscale = _mm512_maskz_mov_ps(seen[r], ks);
                            const __m512 sc = _mm512_mul_ps(
                                _mm512_mul_ps(_mm512_cvtepi32_ps(dot), kscale),
                                _mm512_set1_ps(ws[r].qs[h]));
                            _mm512_storeu_ps(ws[r].s + h * INT8_CHUNK + at,
                                             _mm512_mask_mov_ps(_mm512_set1_ps(NEG_INF), seen[r], sc));
                        }
                    }
                }
            }
        }
        for (int r = 0; r < rows; ++r) {
            if (b0 >= num_blocks[r]) continue;
            const int own = static_cast<int>(std::min<int64_t>(blocks, num_blocks[r] - b0));
            softmax_chunk(ws[r], own * block_size, blocks * block_size, num_heads, G);
        }
        // pass 2: the values, one KV head at a time: its rows interleaved into B tiles
        // once, then every query head of every row against them
        const int width = blocks * block_size;
        const int steps = (width + AMX_K - 1) / AMX_K;
        for (int kh = 0; kh < num_kv_heads; ++kh) {
            for (int i = 0; i < blocks; ++i)
                interleave_values<D>(v8 + sh.bases[i] * row_stride + kh * D, row_stride,
                                     block_size, i * block_size, sh.values);
            for (int j = 0; j < read; ++j) {  // probability bytes, zero past the chunk
                uint8_t* lo_row = p_lo + int64_t{j} * INT8_CHUNK;
                uint8_t* hi_row = p_hi + int64_t{j} * INT8_CHUNK;
                const int r = j / G;
                if (j < M && b0 < num_blocks[r]) {
                    split_i16(ws[r].p16 + (kh * G + j % G) * INT8_CHUNK, width, lo_row, hi_row);
                } else {
                    std::memset(lo_row, 0, width);
                    std::memset(hi_row, 0, width);
                }
                std::memset(lo_row + width, 0, steps * AMX_K - width);
                std::memset(hi_row + width, 0, steps * AMX_K - width);
            }
            for (int tile = 0; tile < tiles; ++tile) {
                const int64_t a_at = int64_t{tile} * AMX_HEAD_TILE * INT8_CHUNK;
                const int last = std::min(AMX_HEAD_TILE, M - tile * AMX_HEAD_TILE);
                for (int vt = 0; vt < VTILES; ++vt) {
                    Tiles::template zero<T_CLO>();
                    Tiles::template zero<T_CHI>();
                    for (int s = 0; s < steps; ++s) {
                        Tiles::template load<T_ALO>(p_lo + a_at + s * AMX_K, INT8_CHUNK);
                        Tiles::template load<T_AHI>(p_hi + a_at + s * AMX_K, INT8_CHUNK);
                        Tiles::template load<T_B>(sh.values + (vt * AMX_STEPS + s) * 1024, 64);
                        Tiles::template dpbusd<T_CLO, T_ALO, T_B>();
                        Tiles::template dpbusd<T_CHI, T_AHI, T_B>();
                    }
                    Tiles::template store<T_CLO>(c_lo, 64);
                    Tiles::template store<T_CHI>(c_hi, 64);
                    for (int m = 0; m < last; ++m) {
                        const int j = tile * AMX_HEAD_TILE + m, r = j / G;
                        if (b0 >= num_blocks[r]) continue;
                        const int h = kh * G + j % G;
                        const __m512i sum = c_row(c_lo, c_hi, m);
                        float* acc = ws[r].acc + h * D + vt * 16;
                        const __m512 corr = _mm512_set1_ps(ws[r].corr[h]);
                        const __m512 ps = _mm512_set1_ps(ws[r].ps[h]);
                        _mm512_storeu_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), ps,
                                                              _mm512_mul_ps(_mm512_loadu_ps(acc), corr)));
                    }
                }
            }
        }
    }
    if (!Tiles::ok()) amx_attention_fault.store(true, std::memory_order_relaxed);
    Tiles::release();
    for (int r = 0; r < rows; ++r)
        finish_row<QT>(ws[r], out, seq0 + r, num_heads, D, amx_value_index);
}

template <class Tiles, int QT>
DecodeRowsFn pick_int8_amx(int head_dim, int block_size) {
    if (block_size % 16 != 0 || block_size > INT8_CHUNK) return nullptr;
    return for_head_dim<DecodeRowsFn, 64, 128, 256>(
        head_dim, [](auto d) { return decode_rows_int8_amx<Tiles, QT, decltype(d)::value>; });
}
#endif

}  // namespace
