// Decode attention over an int8 KV cache with integer dot products, for bfloat16 and
// float16 queries on the AVX512-BF16 build (which has VNNI): vpdpwssd multiplies pairs of
// int16 into int32 sums, so the cache's int8 rows are only sign-extended (one instruction
// per 32 elements) where decode_seq_dpbf16 converts them to bfloat16 through float32
// (five). The query is quantized to int16 per head (step amax / 32767: an error of at
// most amax / 65534 per element, finer than bfloat16's own rounding of every element
// above amax / 128), the probabilities to int16 per head and chunk in the same way; every
// product and sum of them is exact in int32, and the scales multiply once per score and
// once per chunk. The tests hold it to the float32 reference within bfloat16's and
// float16's tolerances (tests/kernels/test_cpu_kernels.py).
//
// Two passes per chunk of INT8_CHUNK positions instead of an online softmax per 16-row block:
// the chunk's scores (its keys read once, block by block), one softmax update for the
// chunk (one max, one rescale of the accumulators), then its values, one KV head at a
// time with its query heads' int32 sums in registers across the whole chunk. A chunk
// bounds the scratch for any context and keeps the value sums from overflowing int32
// (INT8_CHUNK rows of 32767 * 128 products, two per lane and row pair: under 2^31).
//
// Rows the query does not see (other sequences' slots of a shared last block, rows before
// a sliding window) get a score of -inf and a probability of exactly 0: their int8 codes
// are finite whatever they hold, and their scales (which may be anything, NaN included)
// are never read.
//
// Batch-invariant prefill makes every token of a prompt chunk such a query over the
// context up to itself; decode_rows_int8 takes up to INT8_GROUP_ROWS consecutive ones in
// one call, widening each block's keys and each pair of value rows once for all of them
// (30 layers of 3 prompts of 320 tokens on a Zen 4: 90 -> 74-79 ms). Every row's
// arithmetic stays its own: the integer sums are exact in any company.

#pragma once

#include "attention_avx2.h"
#include "attention_avx512_bf16.h"
#include "cache_rows.h"
#include "fast_exp.h"
#include "quant_rows.h"  // set_all

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

#ifdef CADENCE_AVX512_BF16

constexpr int PREFETCH_BLOCKS = 3;  // how far ahead pass 1 asks for keys, values and scales
constexpr int INT8_CHUNK = 256;  // positions per softmax pass (int32 value sums bound)
constexpr float INT16_MAX_F = 32767.0f;

// Lane i of the result is the sum of the 16 lanes of v[i]: reduce16's shuffles, on int32.
[[gnu::always_inline]] inline __m512i reduce16i(const __m512i* v) {
    __m512i t[8], u[4];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    const __m512i x0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88),
                                        _mm512_shuffle_i32x4(u[0], u[1], 0xdd));
    const __m512i x1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x88),
                                        _mm512_shuffle_i32x4(u[2], u[3], 0xdd));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x0, x1, 0x88),
                            _mm512_shuffle_i32x4(x0, x1, 0xdd));
}

// x[0, n) (n a multiple of 16) as int16 q = round(x / s) with s = amax / 32767; returns s.
inline float quantize_i16(const float* x, int n, int16_t* q) {
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float a = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(a > 0.0f ? INT16_MAX_F / a : 0.0f);
    for (int i = 0; i < n; i += 16) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm512_cvtepi32_epi16(v));
    }
    return a / INT16_MAX_F;
}

// 16 rows of int8 (row_stride bytes apart) as int16, D apart in dst; with k_ahead and
// v_ahead (the same KV head's rows of a block further on; null: none), each row's keys and
// values there asked for into L2 beside its widening. Asked for in one burst of 32 lines
// before it, the requests outran the core's fill buffers and the widening and scores
// waited behind them: one row's lines at a time took 30 layers of a 32-row decode at 420
// tokens from 14.1 to 13.0 ms (Emerald Rapids, bits unchanged).
template <int D>
inline void rows_i16(const int8_t* rows, int64_t row_stride, int16_t* dst,
                     const int8_t* k_ahead = nullptr, const int8_t* v_ahead = nullptr) {
    for (int t = 0; t < 16; ++t) {
        if (k_ahead != nullptr)
            for (int c = 0; c < D; c += 64) {
                _mm_prefetch(reinterpret_cast<const char*>(k_ahead + t * row_stride + c),
                             _MM_HINT_T1);
                _mm_prefetch(reinterpret_cast<const char*>(v_ahead + t * row_stride + c),
                             _MM_HINT_T1);
            }
        for (int c = 0; c < D / 32; ++c) {
            const auto* x8 = reinterpret_cast<const __m256i*>(rows + t * row_stride + c * 32);
            const __m256i x = _mm256_loadu_si256(x8);
            _mm512_storeu_si512(dst + t * D + c * 32, _mm512_cvtepi8_epi16(x));
        }
    }
}

// The int32 dot products of one head's int16 query with 16 int16 key rows (D apart).
template <int D>
inline __m512i dots16(const int16_t* q16, const int16_t* keys) {
    __m512i qv[D / 32], dots[16];
    for (int c = 0; c < D / 32; ++c) qv[c] = _mm512_loadu_si512(q16 + c * 32);
    for (int t = 0; t < 16; ++t) {
        dots[t] = _mm512_setzero_si512();
        for (int c = 0; c < D / 32; ++c)
            dots[t] = _mm512_dpwssd_epi32(dots[t], qv[c],
                                          _mm512_loadu_si512(keys + t * D + c * 32));
    }
    return reduce16i(dots);
}

// acc_i[g] += sum over the rows of `blocks` blocks of p[g][t] * V[t] for GB query heads
// of one KV head (of one query row or several): row pairs interleaved (unpacklo/hi on
// int16, the dimension order of accumulate_value_pairs, value_dim_order) against the pair
// (p[t], p[t + 1]) of each head. The int32 sums stay in registers over the whole chunk;
// then acc = acc * corr + sum * ps. Each pair of value rows is widened once for all GB.
template <int D, int GB>
inline void values_int16(const int8_t* v_cache, const int64_t* bases, int blocks,
                         int block_size, int64_t row_stride, const int16_t* const* p,
                         const float* corr, const float* ps, float* const* acc) {
    constexpr int V = D / 16, C = D / 32;
    __m512i a[GB][V];
    cadence_quant::set_all(a, _mm512_setzero_si512());
    for (int b = 0; b < blocks; ++b) {
        const int8_t* rows = v_cache + bases[b] * row_stride;
        for (int t = 0; t < block_size; t += 2) {
            const int8_t* r0 = rows + t * row_stride;
            __m512i pairs[V];
            for (int k = 0; k < C; ++k) {
                const __m512i x = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + k * 32)));
                const __m512i y = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + row_stride + k * 32)));
                pairs[2 * k] = _mm512_unpacklo_epi16(x, y);
                pairs[2 * k + 1] = _mm512_unpackhi_epi16(x, y);
            }
            for (int g = 0; g < GB; ++g) {
                int32_t pp;
                std::memcpy(&pp, p[g] + b * block_size + t, sizeof pp);
                const __m512i w = _mm512_set1_epi32(pp);
                for (int c = 0; c < V; ++c) a[g][c] = _mm512_dpwssd_epi32(a[g][c], pairs[c], w);
            }
        }
    }
    for (int g = 0; g < GB; ++g) {
        const __m512 c = _mm512_set1_ps(corr[g]), s = _mm512_set1_ps(ps[g]);
        for (int v = 0; v < V; ++v) {
            float* out = acc[g] + v * 16;
            _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[g][v]), s,
                                                  _mm512_mul_ps(_mm512_loadu_ps(out), c)));
        }
    }
}

template <int D>
inline void values_heads(const int8_t* v_cache, const int64_t* bases, int blocks, int block_size,
                         int64_t row_stride, const int16_t* const* p, const float* corr,
                         const float* ps, float* const* acc, int heads) {
    constexpr int MAX = heads_per_pass<D>();
    for (int g0 = 0; g0 < heads; g0 += MAX) {
        switch (std::min(MAX, heads - g0)) {
#define CADENCE_VALUES(N)                                                                  \
    case N:                                                                                \
        if constexpr (N <= MAX)                                                            \
            values_int16<D, N>(v_cache, bases, blocks, block_size, row_stride, p + g0,     \
                               corr + g0, ps + g0, acc + g0);                              \
        break;
            CADENCE_VALUES(1) CADENCE_VALUES(2) CADENCE_VALUES(3) CADENCE_VALUES(4)
            CADENCE_VALUES(5) CADENCE_VALUES(6) CADENCE_VALUES(7) CADENCE_VALUES(8)
#undef CADENCE_VALUES
        }
    }
}

// The most query rows decode_rows_int8 takes together: the consecutive tokens of one
// prompt chunk, each a query over the context up to itself (batch-invariant prefill).
constexpr int INT8_GROUP_ROWS = 8;

// What the rows of one decode_rows_int8 call share, at the front of its scratch: the
// chunk's blocks' first slots (INT8_CHUNK int64) and a block's 16 key rows of one KV head
// as int16 ([16, D]); each row's Int8Scratch follows.
constexpr int64_t int8_shared_floats(int D) { return 2 * INT8_CHUNK + 8 * D; }

// decode_rows_int8's scratch of one query row, over a float buffer.
struct Int8Scratch {
    float* s;      // [H, CHUNK] scores, then probabilities times their value scales
    float* vsc;    // [KVH, CHUNK] value scales of the chunk's rows (0 where unseen)
    float* acc;    // [H, D] value_dim_order
    float* m;      // [H] running max
    float* l;      // [H] running sum
    float* qs;     // [H] the int16 queries' scales
    float* corr;   // [H] this chunk's rescale of acc
    float* ps;     // [H] this chunk's probability scales
    float* row;    // [D]
    int16_t* q16;  // [H, D]
    int16_t* p16;  // [H, CHUNK]

    static int64_t floats(int H, int KVH, int D) {
        const int64_t f = static_cast<int64_t>(H) * (INT8_CHUNK + D + 6) + KVH * INT8_CHUNK + D;
        const int64_t halves = static_cast<int64_t>(H) * (D + INT8_CHUNK);
        return f + (halves + 1) / 2;
    }
    Int8Scratch() = default;
    [[gnu::always_inline]] Int8Scratch(float* base, int H, int KVH, int D) {
        s = base;
        vsc = s + H * INT8_CHUNK;
        acc = vsc + KVH * INT8_CHUNK;
        m = acc + H * D;
        l = m + H;
        qs = l + H;
        corr = qs + H;
        ps = corr + H;
        row = ps + H;
        q16 = reinterpret_cast<int16_t*>(row + D);
        p16 = q16 + H * D;
    }
};

// A query row's start: its heads quantized to int16 (scales times `scale`), the
// accumulators, running max and sum cleared. Returns how many blocks it reads.
template <int QT>
inline int64_t start_row(Int8Scratch& w, const void* q, int64_t row, int num_heads, int D,
                         float scale, int64_t context_len, int block_size) {
    for (int h = 0; h < num_heads; ++h) {
        load_row<QT>(q, (row * num_heads + h) * D, w.row, D);
        w.qs[h] = quantize_i16(w.row, D, w.q16 + h * D) * scale;
    }
    std::fill(w.acc, w.acc + num_heads * D, 0.0f);
    std::fill(w.m, w.m + num_heads, NEG_INF);
    std::fill(w.l, w.l + num_heads, 0.0f);
    return (context_len + block_size - 1) / block_size;
}

// A query row's end: each head's accumulators (dimension d at acc[index(d)], gathered 16 at
// a time from a table of index made once) over its softmax sum, into the output row.
template <int QT, class Index>
inline void finish_row(Int8Scratch& w, void* out, int64_t row, int num_heads, int D,
                       Index index) {
    alignas(64) int32_t at[256];  // D <= 256
    for (int d = 0; d < D; ++d) at[d] = index(d);
    for (int h = 0; h < num_heads; ++h) {
        const float inv = w.l[h] > 0.0f ? 1.0f / w.l[h] : 0.0f;  // no visible key: zeros
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(w.row + d, _mm512_i32gather_ps(_mm512_load_si512(at + d),
                                                            w.acc + h * D, 4));
        store_row<QT>(out, (row * num_heads + h) * D, w.row, inv, D);
    }
}

// The bits of a block's 16 rows r0.. that a query row sees: those in [lo, hi).
inline __mmask16 seen_mask(int r0, int64_t lo, int64_t hi) {
    const int64_t a = std::clamp<int64_t>(lo - r0, 0, 16), b = std::clamp<int64_t>(hi - r0, 0, 16);
    if (b <= a) return 0;
    const uint32_t upto = b >= 16 ? 0xFFFFu : (1u << b) - 1u;
    return static_cast<__mmask16>(upto & ~((1u << a) - 1u));
}

// The offsets of 16 consecutive slots' scales of one KV head ([slot, KV head] floats).
inline __m512i scale_gather_index(int num_kv_heads) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_mullo_epi32(iota, _mm512_set1_epi32(num_kv_heads));
}

// One query row's G heads of KV head kh against 16 key rows (int16 in `keys`): scores into
// w.s at `at`, -inf where the row does not see the key (bits of `seen`); the keys' value
// scales into w.vsc (0 where unseen). ks, vs: the 16 keys' scales, gathered where any row
// of the call sees them (a row's unseen lanes, which may hold anything, are masked off).
template <int D>
[[gnu::always_inline]] inline void score16(Int8Scratch& w, const int16_t* keys, __m512 ks,
                                           __m512 vs, __mmask16 seen, int kh, int G, int at) {
    _mm512_storeu_ps(w.vsc + kh * INT8_CHUNK + at, _mm512_maskz_mov_ps(seen, vs));
    const __m512 kscale = _mm512_maskz_mov_ps(seen, ks);
    for (int g = 0; g < G; ++g) {
        const int h = kh * G + g;
        const __m512 dot = _mm512_cvtepi32_ps(dots16<D>(w.q16 + h * D, keys));
        const __m512 sc = _mm512_mul_ps(_mm512_mul_ps(dot, kscale), _mm512_set1_ps(w.qs[h]));
        _mm512_storeu_ps(w.s + h * INT8_CHUNK + at,
                         _mm512_mask_mov_ps(_mm512_set1_ps(NEG_INF), seen, sc));
    }
}

// One softmax update per head for a chunk of n positions; probabilities times their value
// scales, as int16 with a scale of the head's own. p16 is zero from n to `width`.
inline void softmax_chunk(Int8Scratch& w, int n, int width, int num_heads, int G) {
    for (int h = 0; h < num_heads; ++h) {
        float* sh = w.s + h * INT8_CHUNK;
        int16_t* ph = w.p16 + h * INT8_CHUNK;
        std::fill(ph + n, ph + width, int16_t{0});
        const float* vs = w.vsc + (h / G) * INT8_CHUNK;
        __m512 mx = _mm512_set1_ps(NEG_INF);
        for (int i = 0; i < n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sh + i));
        const float m_new = std::max(w.m[h], _mm512_reduce_max_ps(mx));
        if (m_new == NEG_INF) {  // nothing seen in this chunk: it adds nothing
            w.corr[h] = 1.0f;
            w.ps[h] = 0.0f;
            std::fill(ph, ph + n, int16_t{0});
            continue;
        }
        w.corr[h] = fast_exp(w.m[h] - m_new);
        const __m512 mv = _mm512_set1_ps(m_new);
        __m512 sum = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + i), mv));
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(sh + i, _mm512_mul_ps(e, _mm512_loadu_ps(vs + i)));
        }
        w.l[h] = w.l[h] * w.corr[h] + _mm512_reduce_add_ps(sum);
        w.m[h] = m_new;
        w.ps[h] = quantize_i16(sh, n, ph);
    }
}

// `rows` consecutive query rows (seq0..) over an int8 cache, all reading one block table
// with context_lens[j] = context_lens[0] + j (the tokens of one prompt chunk; one row for a
// decode): block_size a multiple of 16 up to INT8_CHUNK, bfloat16 or float16 queries and
// output, head_dim D a multiple of 32. Each row's arithmetic is exactly its own as a query
// alone: the keys are widened to int16 once for all rows and each pair of value rows once
// per pass of heads, and the integer sums are exact whatever rows share a pass; a row adds
// only the chunks and blocks it sees (a longer row's extra block gets its zero
// probabilities). A sliding window takes one row at a time (each row's chunks start where
// its window does).
template <int QT, int D>
void decode_rows_int8(const void* q, void* out, const void* k_cache, const void* v_cache,
                      const float* k_scale, const float* v_scale, const int64_t* table,
                      const int64_t* context_lens, int64_t seq0, int rows, int num_heads,
                      int num_kv_heads, int block_size, float scale, int64_t window,
                      float* scratch) {
    const int G = num_heads / num_kv_heads;
    auto* bases = reinterpret_cast<int64_t*>(scratch);  // 8-byte aligned: an allocation's start
    auto* keys = reinterpret_cast<int16_t*>(scratch + 2 * INT8_CHUNK);
    float* row_scratch = scratch + int8_shared_floats(D);
    const int64_t per_row = Int8Scratch::floats(num_heads, num_kv_heads, D);
    Int8Scratch ws[INT8_GROUP_ROWS];
    int64_t num_blocks[INT8_GROUP_ROWS];
    int64_t num_blocks_all = 0;
    for (int r = 0; r < rows; ++r) {
        ws[r] = Int8Scratch(row_scratch + r * per_row, num_heads, num_kv_heads, D);
        num_blocks[r] = start_row<QT>(ws[r], q, seq0 + r, num_heads, D, scale, context_lens[r],
                                      block_size);
        num_blocks_all = std::max(num_blocks_all, num_blocks[r]);
    }
    const auto* k8 = static_cast<const int8_t*>(k_cache);
    const auto* v8 = static_cast<const int8_t*>(v_cache);
    const int64_t row_stride = static_cast<int64_t>(num_kv_heads) * D;  // bytes
    const int64_t block_bytes = block_size * row_stride;
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, context_lens[0] - window) : 0;
    const int chunk_blocks = INT8_CHUNK / block_size;
    const int64_t first_block = first_key / block_size;
    const __m512i scale_index = scale_gather_index(num_kv_heads);
    constexpr int HEADS = 64;  // value passes' heads gathered at once (rows x their heads)
    const int16_t* p[HEADS];
    float* acc[HEADS];
    float corr[HEADS], ps[HEADS];
    auto prefetch_scales = [&](int64_t slot) {  // a block's key and value scales
        prefetch_block(k_scale + slot * num_kv_heads, block_size * num_kv_heads * 4);
        prefetch_block(v_scale + slot * num_kv_heads, block_size * num_kv_heads * 4);
    };
    const int64_t first_ahead = std::min(num_blocks_all, first_block + PREFETCH_BLOCKS);
    for (int64_t b = first_block; b < first_ahead; ++b) {  // the first blocks, asked for at once
        const int64_t slot = table[b] * block_size;
        prefetch_block(k8 + slot * row_stride, block_bytes);
        prefetch_block(v8 + slot * row_stride, block_bytes);
        prefetch_scales(slot);
    }
    for (int64_t b0 = first_block; b0 < num_blocks_all; b0 += chunk_blocks) {
        const int blocks = static_cast<int>(std::min<int64_t>(chunk_blocks, num_blocks_all - b0));
        // pass 1: every block's scores, block by block (its keys read front to back once)
        for (int i = 0; i < blocks; ++i) {
            const int64_t b = b0 + i;
            bases[i] = table[b] * block_size;
            // the block PREFETCH_BLOCKS ahead: its scales now, its keys and values (for pass
            // 2) a row of a KV head at a time, beside the widening of this block's keys
            const int64_t ahead =
                b + PREFETCH_BLOCKS < num_blocks_all ? table[b + PREFETCH_BLOCKS] * block_size : -1;
            if (ahead >= 0) prefetch_scales(ahead);
            const int8_t* k_ahead = ahead >= 0 ? k8 + ahead * row_stride : nullptr;
            const int8_t* v_ahead = ahead >= 0 ? v8 + ahead * row_stride : nullptr;
            const int64_t lo = std::max<int64_t>(0, first_key - b * block_size);
            for (int r0 = 0; r0 < block_size; r0 += 16) {
                __mmask16 seen[INT8_GROUP_ROWS], any = 0;
                for (int r = 0; r < rows; ++r) {
                    const int64_t hi =
                        std::min<int64_t>(block_size, context_lens[r] - b * block_size);
                    seen[r] = b < num_blocks[r] ? seen_mask(r0, lo, hi) : 0;
                    any |= seen[r];
                }
                const int64_t slot0 = bases[i] + r0;
                for (int kh = 0; kh < num_kv_heads; ++kh) {
                    // the keys' scales, read only where some row sees the key
                    const __m512 zero = _mm512_setzero_ps();
                    const __m512 ks = _mm512_mask_i32gather_ps(
                        zero, any, scale_index, k_scale + slot0 * num_kv_heads + kh, 4);
                    const __m512 vs = _mm512_mask_i32gather_ps(
                        zero, any, scale_index, v_scale + slot0 * num_kv_heads + kh, 4);
                    const int64_t at = r0 * row_stride + kh * D;  // in the block ahead
                    rows_i16<D>(k8 + slot0 * row_stride + kh * D, row_stride, keys,
                                k_ahead ? k_ahead + at : nullptr, v_ahead ? v_ahead + at : nullptr);
                    for (int r = 0; r < rows; ++r)
                        if (b < num_blocks[r])
                            score16<D>(ws[r], keys, ks, vs, seen[r], kh, G, i * block_size + r0);
                }
            }
        }
        for (int r = 0; r < rows; ++r) {
            if (b0 >= num_blocks[r]) continue;
            const int own = static_cast<int>(std::min<int64_t>(blocks, num_blocks[r] - b0));
            softmax_chunk(ws[r], own * block_size, blocks * block_size, num_heads, G);
        }
        // pass 2: the values, one KV head at a time over the chunk's blocks, every row's
        // heads of it together (HEADS at most per call; each head's sums are its own)
        for (int kh = 0; kh < num_kv_heads; ++kh) {
            int n = 0;
            for (int r = 0; r < rows; ++r) {
                if (b0 >= num_blocks[r]) continue;
                for (int g = 0; g < G; ++g) {
                    const int h = kh * G + g;
                    p[n] = ws[r].p16 + h * INT8_CHUNK;
                    acc[n] = ws[r].acc + h * D;
                    corr[n] = ws[r].corr[h];
                    ps[n] = ws[r].ps[h];
                    if (++n == HEADS) {
                        values_heads<D>(v8 + kh * D, bases, blocks, block_size, row_stride, p,
                                        corr, ps, acc, n);
                        n = 0;
                    }
                }
            }
            values_heads<D>(v8 + kh * D, bases, blocks, block_size, row_stride, p, corr, ps,
                            acc, n);
        }
    }
    for (int r = 0; r < rows; ++r)
        finish_row<QT>(ws[r], out, seq0 + r, num_heads, D, value_dim_order);
}

template <int QT>
DecodeRowsFn pick_int8(int head_dim, int block_size) {
    if (block_size % 16 != 0 || block_size > INT8_CHUNK) return nullptr;
    return for_head_dim<DecodeRowsFn, 32, 64, 96, 128, 256>(
        head_dim, [](auto d) { return decode_rows_int8<QT, decltype(d)::value>; });
}
#endif

}  // namespace
