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
#include "attention_int8_avx512.h"
#include "cache_rows.h"
#include "cpu_elements.h"
#include "cpu_kernels.h"
#include "attention_shared.h"
#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace cadence_kernels;  // DType, Status

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

// fn (a kernel of several rows over one table) over every sequence, consecutive rows
// that one call can take (contexts one longer each, the same table, no sliding window) in
// groups of up to max_rows, the groups in parallel, each thread with a scratch of
// shared_floats plus row_floats per row of the largest group.
inline void decode_row_groups(DecodeRowsFn fn, int64_t shared_floats, int64_t row_floats,
                              int max_rows, const void* q,
                              void* out, const void* k_cache, const void* v_cache,
                              const float* k_scale, const float* v_scale,
                              const int64_t* block_tables, int64_t table_stride,
                              const int64_t* context_lens, int64_t num_seqs, int num_heads,
                              int num_kv_heads, int block_size, float scale, int64_t window,
                              int num_threads) {
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
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scratch(shared_floats + widest * row_floats);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < groups; ++i) {
            const int64_t s = starts[i];
            fn(q, out, k_cache, v_cache, k_scale, v_scale, block_tables + s * table_stride,
               context_lens + s, s, static_cast<int>(starts[i + 1] - s), num_heads,
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
        if (DecodeRowsFn rows_fn = pick_int8<QT>(head_dim, block_size))
            return decode_row_groups(rows_fn, int8_shared_floats(head_dim),
                                     Int8Scratch::floats(num_heads, num_kv_heads, head_dim),
                                     INT8_GROUP_ROWS, q, out, k_cache, v_cache, k_scale, v_scale,
                                     block_tables, table_stride, context_lens, num_seqs, num_heads,
                                     num_kv_heads, block_size, scale, window, num_threads);
    }
    if (fn == nullptr) if constexpr (dpbf16_serves<QT, KT>()) {
        fn = pick_dpbf16<QT, KT>(head_dim);
        scratch_floats =
            Dpbf16Scratch::floats(num_heads, head_dim, block_size, bf16_pieces<QT>());
    }
#endif
#ifdef CADENCE_AVX2
    if (fn == nullptr) {
        fn = pick_avx2<QT, KT>(head_dim, block_size);
        scratch_floats = num_heads * (2 * head_dim + block_size + 3) + head_dim + block_size;
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

}  // namespace

extern "C" {

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
        return OK;                                                                          \
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
