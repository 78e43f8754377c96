// Paged decode attention, the kernels of the shard's `cpu` attention backend: one query
// per sequence reads its keys and values straight from the paged cache through its block
// table (no gather into a padded copy), with the query heads of one KV head together,
// online softmax over blocks. On the AVX512-BF16 build an int8 cache under bfloat16 or
// float16 queries takes integer dot products (attention_int8_avx512.h), every other pair
// it can the vdpbf16ps path (attention_avx512_bf16.h); else the AVX2 one
// (attention_avx2.h), else the portable one below. Entry points:
// cadence_paged_decode_attention, and cadence_decode_layer_attention (rotary_kernels.cpp's
// KV write, then the attention, in one call for a decode-only step).

#include "attention_avx2.h"
#include "attention_avx512_bf16.h"
#include "attention_int8_amx.h"
#include "attention_int8_avx512.h"
#include "cache_rows.h"
#include "cpu_elements.h"
#include "cpu_kernels.h"
#include "attention_shared.h"
#include "fast_exp.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace cadence_kernels;  // DType, Status

// Which tiles an int8 cache's kernel runs on (cadence_attention_tiles): 0 the VNNI vector
// code, TILES_AMX or TILES_EMULATED attention_int8_amx.h's, bitwise equal to it; the tiles
// take the calls of at least attention_tiles_min_rows rows (a prompt chunk's tokens).
std::atomic<int> attention_tiles{0};
std::atomic<int> attention_tiles_min_rows{1};

// One (sequence, KV head) pair: its G query heads against every visible key. QT is the
// element type of the query and output, KT the cache's (they differ with --kv-cache-dtype).
template <int QT, int KT>
void decode_one(const void* q, void* out, const void* k_cache, const void* v_cache,
                const float* k_scale, const float* v_scale, const int64_t* table,
                int64_t context_len, int64_t seq, int kv_head,
                int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                int64_t window, float* scratch) {
    const int G = num_heads / num_kv_heads;
    const int D = head_dim;
    float* qf = scratch;                   // [G, D]
    float* acc = qf + G * D;               // [G, D]
    float* kv = acc + G * D;               // [block_size, D]
    float* s = kv + block_size * D;        // [G, block_size]
    float* m = s + G * block_size;         // [G] running max
    float* l = m + G;                      // [G] running sum
    for (int g = 0; g < G; ++g) {
        const int64_t row = (seq * num_heads + kv_head * G + g) * D;
        load_row<QT>(q, row, qf + g * D, D);
        for (int d = 0; d < D; ++d) qf[g * D + d] *= scale;
        std::fill(acc + g * D, acc + (g + 1) * D, 0.0f);
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }
    // The query sits at position context_len - 1; with a sliding window it sees keys
    // k with k > position - window.
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
    const int64_t row_stride = static_cast<int64_t>(num_kv_heads) * D;
    for (int64_t b = first_key / block_size; b * block_size < context_len; ++b) {
        const int64_t base = table[b] * block_size;  // slot of the block's first token
        const int lo = static_cast<int>(std::max<int64_t>(0, first_key - b * block_size));
        const int hi = static_cast<int>(std::min<int64_t>(block_size, context_len - b * block_size));
        for (int t = lo; t < hi; ++t) {
            load_row<KT>(k_cache, (base + t) * row_stride + kv_head * D, kv + t * D, D);
            if constexpr (quantized<KT>()) {
                const float ks = row_scale<KT>(k_scale, (base + t) * num_kv_heads + kv_head);
                for (int d = 0; d < D; ++d) kv[t * D + d] *= ks;
            }
        }
        for (int g = 0; g < G; ++g) {
            for (int t = lo; t < hi; ++t) {
                float dot = 0.0f;
                const float* kt = kv + t * D;
                const float* qg = qf + g * D;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; ++d) dot += qg[d] * kt[d];
                s[g * block_size + t] = dot;
            }
            online_softmax_block(s + g * block_size, lo, hi, m[g], l[g], acc + g * D, D);
        }
        for (int t = lo; t < hi; ++t) {
            load_row<KT>(v_cache, (base + t) * row_stride + kv_head * D, kv + t * D, D);
            if constexpr (quantized<KT>()) {
                const float vs = row_scale<KT>(v_scale, (base + t) * num_kv_heads + kv_head);
                for (int d = 0; d < D; ++d) kv[t * D + d] *= vs;
            }
        }
        for (int g = 0; g < G; ++g) {
            float* ag = acc + g * D;
            for (int t = lo; t < hi; ++t) {
                const float p = s[g * block_size + t];
                const float* vt = kv + t * D;
#pragma omp simd
                for (int d = 0; d < D; ++d) ag[d] += p * vt[d];
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        const int64_t row = (seq * num_heads + kv_head * G + g) * D;
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;  // no visible key: zeros
        store_row<QT>(out, row, acc + g * D, inv, D);
    }
}

// fn (a whole-sequence kernel) over every sequence, in parallel, each thread with
// scratch_floats of its own.
inline void decode_sequences(DecodeSeqFn fn, int64_t scratch_floats, const void* q, void* out,
                             const void* k_cache, const void* v_cache, const float* k_scale,
                             const float* v_scale, const int64_t* block_tables,
                             int64_t table_stride, const int64_t* context_lens, int64_t num_seqs,
                             int num_heads, int num_kv_heads, int block_size, float scale,
                             int64_t window, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scratch(scratch_floats);
#pragma omp for schedule(dynamic, 1)
        for (int64_t seq = 0; seq < num_seqs; ++seq)
            fn(q, out, k_cache, v_cache, k_scale, v_scale, block_tables + seq * table_stride,
               context_lens[seq], seq, num_heads, num_kv_heads, block_size, scale, window,
               scratch.data());
    }
}

// Whether rows a and b read the same blocks up to `blocks` (the tokens of one prompt
// chunk do: each row holds a copy of its sequence's table).
inline bool same_table(const int64_t* a, const int64_t* b, int64_t blocks) {
    return std::equal(a, a + blocks, b);
}

// A kernel of several rows over one table (DecodeRowsFn) with its scratch: shared_floats
// per call, row_floats per row, at most max_rows rows a call.
struct RowsKernel {
    DecodeRowsFn fn = nullptr;
    int64_t shared_floats = 0, row_floats = 0;
    int max_rows = 1;
};

// Every sequence through `vnni` or `tiles` (bitwise equal kernels; tiles.fn null: none):
// consecutive rows that one call can take (contexts one longer each, the same table, no
// sliding window) in groups of up to the larger max_rows, the groups in parallel; a group
// of at least tiles_min_rows rows on the tiles, any other on the vnni kernel (in pieces
// of its max_rows). Each thread has the scratch of the largest group.
inline void decode_row_groups(const RowsKernel& vnni, const RowsKernel& tiles,
                              int tiles_min_rows, const void* q, void* out, const void* k_cache,
                              const void* v_cache, const float* k_scale, const float* v_scale,
                              const int64_t* block_tables, int64_t table_stride,
                              const int64_t* context_lens, int64_t num_seqs, int num_heads,
                              int num_kv_heads, int block_size, float scale, int64_t window,
                              int num_threads) {
    const int max_rows = tiles.fn ? std::max(vnni.max_rows, tiles.max_rows) : vnni.max_rows;
    std::vector<int64_t> starts;
    int64_t widest = 1;
    for (int64_t s = 0; s < num_seqs;) {
        int64_t e = s + 1;
        while (window <= 0 && e < num_seqs && e - s < max_rows &&
               context_lens[e] == context_lens[e - 1] + 1 &&
               same_table(block_tables + s * table_stride, block_tables + e * table_stride,
                          (context_lens[e] + block_size - 1) / block_size))
            ++e;
        starts.push_back(s);
        widest = std::max(widest, e - s);
        s = e;
    }
    starts.push_back(num_seqs);
    const auto groups = static_cast<int64_t>(starts.size()) - 1;
    int64_t floats =
        vnni.shared_floats + std::min<int64_t>(widest, vnni.max_rows) * vnni.row_floats;
    if (tiles.fn) floats = std::max(floats, tiles.shared_floats + widest * tiles.row_floats);
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scratch(floats);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < groups; ++i) {
            const int64_t s = starts[i], n = starts[i + 1] - s;
            const bool on_tiles = tiles.fn && n >= tiles_min_rows;
            const RowsKernel& k = on_tiles ? tiles : vnni;
            for (int64_t r = 0; r < n; r += k.max_rows)
                k.fn(q, out, k_cache, v_cache, k_scale, v_scale,
                     block_tables + (s + r) * table_stride, context_lens + s + r, s + r,
                     static_cast<int>(std::min<int64_t>(k.max_rows, n - r)), num_heads,
                     num_kv_heads, block_size, scale, window, scratch.data());
        }
    }
}

template <int QT, int KT>
void decode_all(const void* q, void* out, const void* k_cache, const void* v_cache,
                const float* k_scale, const float* v_scale, const int64_t* block_tables, int64_t table_stride, const int64_t* context_lens,
                int64_t num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                float scale, int64_t window, int num_threads) {
    DecodeSeqFn fn = nullptr;
    int64_t scratch_floats = 0;
#ifdef CADENCE_AVX512_BF16
    if constexpr (KT == I8 && QT != F32) {  // a float32 query keeps dpbf16's exact pieces
        const int tiles = attention_tiles.load(std::memory_order_relaxed);
        const int G = num_heads / num_kv_heads;
        const int64_t row_floats = Int8Scratch::floats(num_heads, num_kv_heads, head_dim);
        RowsKernel amx;
        amx.fn = tiles == TILES_AMX
                     ? pick_int8_amx<cadence_amx::HardwareTiles, QT>(head_dim, block_size)
                 : tiles == TILES_EMULATED
                     ? pick_int8_amx<cadence_amx::EmulatedTiles, QT>(head_dim, block_size)
                     : nullptr;
        amx.shared_floats = amx_shared_floats(num_kv_heads, head_dim, G);
        amx.row_floats = row_floats;
        amx.max_rows = AMX_GROUP_ROWS;
        RowsKernel vnni{pick_int8<QT>(head_dim, block_size), int8_shared_floats(head_dim),
                        row_floats, INT8_GROUP_ROWS};
        if (vnni.fn != nullptr)
            return decode_row_groups(vnni, amx, attention_tiles_min_rows.load(), q, out, k_cache,
                                     v_cache, k_scale, v_scale, block_tables, table_stride,
                                     context_lens, num_seqs, num_heads, num_kv_heads, block_size,
                                     scale, window, num_threads);
    }
    if (fn == nullptr) if constexpr (dpbf16_serves<QT, KT>()) {
        fn = pick_dpbf16<QT, KT>(head_dim);
        scratch_floats =
            Dpbf16Scratch::floats(num_heads, head_dim, block_size, bf16_pieces<QT>());
    }
#endif
#ifdef CADENCE_AVX2
    if constexpr (KT == I8) if (fn == nullptr) {  // a prompt chunk's rows scale each block once
        const RowsKernel rows{pick_rows_avx2_i8<QT>(head_dim, block_size),
                              avx2_i8_shared_floats(head_dim, num_heads, block_size),
                              OnlineRowI8::row_floats(num_heads, head_dim), AVX2_I8_GROUP_ROWS};
        if (rows.fn != nullptr)
            return decode_row_groups(rows, RowsKernel{}, 1, q, out, k_cache, v_cache, k_scale,
                                     v_scale, block_tables, table_stride, context_lens, num_seqs,
                                     num_heads, num_kv_heads, block_size, scale, window,
                                     num_threads);
    }
    if (fn == nullptr) {
        fn = pick_avx2<QT, KT>(head_dim, block_size);
        scratch_floats = avx2_seq_floats(head_dim, num_heads, block_size);
    }
#endif
    if (fn != nullptr)
        return decode_sequences(fn, scratch_floats, q, out, k_cache, v_cache, k_scale, v_scale,
                                block_tables, table_stride, context_lens, num_seqs, num_heads,
                                num_kv_heads, block_size, scale, window, num_threads);
    const int G = num_heads / num_kv_heads;
    const int64_t per_thread = 2 * G * head_dim + block_size * head_dim + G * block_size + 2 * G;
    const int64_t items = num_seqs * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scratch(per_thread);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t seq = item / num_kv_heads;
            const int kv_head = static_cast<int>(item % num_kv_heads);
            decode_one<QT, KT>(q, out, k_cache, v_cache, k_scale, v_scale,
                               block_tables + seq * table_stride,
                           context_lens[seq], seq, kv_head, num_heads, num_kv_heads, head_dim,
                           block_size, scale, window, scratch.data());
        }
    }
}

// Whether the emulated tiles faulted since the last call (and forget it).
inline bool tile_fault() {
#ifdef CADENCE_AVX512_BF16
    return amx_attention_fault.exchange(false, std::memory_order_relaxed);
#else
    return false;
#endif
}

}  // namespace

extern "C" {

int cadence_attention_tiles(int tiles, int min_rows, int* previous, int* previous_min_rows) {
    *previous = attention_tiles.load();
    *previous_min_rows = attention_tiles_min_rows.load();
    if (min_rows < 1) return BAD_TILES;
    if (tiles == 0) {
        attention_tiles.store(0);
        attention_tiles_min_rows.store(min_rows);
        return OK;
    }
    if (tiles != TILES_AMX && tiles != TILES_EMULATED) return BAD_TILES;
#ifdef CADENCE_AVX512_BF16
    if (tiles == TILES_AMX && cadence_amx_request() != 1) return NO_AMX;
    attention_tiles_min_rows.store(min_rows);
    attention_tiles.store(tiles);
    return OK;
#else
    return NO_AMX_KERNEL;
#endif
}

// q, out: [num_seqs, num_heads, head_dim] of q_dtype; caches of kv_dtype: [num_blocks, block_size, num_kv_heads,
// head_dim]; block_tables: [num_seqs, table_stride] int64; context_lens: [num_seqs]
// int64 (keys visible to each query, itself included). window <= 0: no sliding window.
int cadence_paged_decode_attention(const void* q, void* out, const void* k_cache,
                                   const void* v_cache, const float* k_scale,
                                   const float* v_scale, const int64_t* block_tables,
                                   int64_t table_stride, const int64_t* context_lens,
                                   int64_t num_seqs, int num_heads, int num_kv_heads,
                                   int head_dim, int block_size, float scale, int64_t window,
                                   int q_dtype, int kv_dtype, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return BAD_HEADS;
#define CADENCE_DECODE(QT, KT)                                                              \
    if (q_dtype == QT && kv_dtype == KT) {                                                  \
        decode_all<QT, KT>(q, out, k_cache, v_cache, k_scale, v_scale, block_tables,        \
                           table_stride, context_lens, num_seqs, num_heads, num_kv_heads,   \
                           head_dim, block_size, scale, window, num_threads);               \
        return tile_fault() ? TILE_FAULT : OK;                                              \
    }
    CADENCE_DECODE(F32, F32)
    CADENCE_DECODE(BF16, BF16)
    CADENCE_DECODE(F16, F16)
    CADENCE_DECODE(F32, BF16)
    CADENCE_DECODE(F32, F16)
    CADENCE_DECODE(BF16, F32)
    CADENCE_DECODE(F16, F32)
    CADENCE_DECODE(F32, I8)
    CADENCE_DECODE(BF16, I8)
    CADENCE_DECODE(F16, I8)
    CADENCE_DECODE(F32, F8E4M3)
    CADENCE_DECODE(BF16, F8E4M3)
    CADENCE_DECODE(F16, F8E4M3)
    CADENCE_DECODE(F32, F8E5M2)
    CADENCE_DECODE(BF16, F8E5M2)
    CADENCE_DECODE(F16, F8E5M2)
#undef CADENCE_DECODE
    return BAD_DTYPE;
}

// A decode step's whole attention for one layer in one call: cadence_rotary_write_kv for
// the num_seqs new tokens (one per sequence, q_out their rotated queries), then
// cadence_paged_decode_attention of q_out into out.
int cadence_decode_layer_attention(const void* qkv, int64_t x_stride, const void* cos,
                                   const void* sin, void* q_out, void* out, void* k_cache,
                                   void* v_cache, float* k_scale, float* v_scale,
                                   const int64_t* slots,
                                   const int64_t* block_tables, int64_t table_stride,
                                   const int64_t* context_lens, int64_t num_seqs, int num_heads,
                                   int num_kv_heads, int head_dim, int block_size, float scale,
                                   int64_t window, int dtype, int kv_dtype, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return BAD_HEADS;
    const int written = cadence_rotary_write_kv(qkv, num_seqs, x_stride, num_heads, num_kv_heads,
                                                head_dim, cos, sin, q_out, k_cache, v_cache,
                                                k_scale, v_scale, slots, dtype, kv_dtype,
                                                num_threads);
    if (written != 0) return written;
    return cadence_paged_decode_attention(q_out, out, k_cache, v_cache, k_scale, v_scale,
                                          block_tables,
                                          table_stride, context_lens, num_seqs, num_heads,
                                          num_kv_heads, head_dim, block_size, scale, window,
                                          dtype, kv_dtype, num_threads);
}

}  // extern "C"
