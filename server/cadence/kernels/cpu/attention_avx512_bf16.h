// The AVX512-BF16 decode attention of attention_kernels.cpp (the avx512_bf16 build): a
// whole sequence per call (attention_shared.h) with vdpbf16ps; it prefetches as the AVX2
// path does (attention_avx2.h).

#pragma once

#include "attention_avx2.h"
#include "cache_rows.h"
#include "cpu_elements.h"
#include "attention_shared.h"
#include "fast_exp.h"

#include <cstdint>

namespace {

using namespace cadence_kernels;  // DType, Status

#ifdef CADENCE_AVX512_BF16
// Decode attention with AVX512-BF16's vdpbf16ps (bfloat16 pairs into float32, exact
// products), head_dim D a multiple of 32 (up to 256): one sequence, all of its KV heads,
// so each cache block is read front to back once. It reads a bfloat16 cache as stored
// and an int8 one (under float32 queries: bfloat16 and float16 ones take the integer
// path of attention_int8_avx512.h) converted to bfloat16 in registers (exact: every int8
// value is a bfloat16 one): a block's keys once per KV head into scratch, which all of its query
// heads score, its values as they are read for the query heads' accumulation. Scores are
// vdpbf16ps of the query against the key rows; values are accumulated two rows at a time
// against the probabilities as bfloat16, in float32 registers. An int8 cache's per-row scales
// stay outside the inner loops: each row's score is multiplied by its key scale, each
// row's probability by its value scale before accumulation (the sum l takes the plain
// probabilities).
//
// Precision: a bfloat16 query and the probabilities for a bfloat16 output are single
// bfloat16s (the rounding the output gets anyway). A float32 query, and the probabilities
// for a float32 output, are carried as the sum of 3 bfloat16 pieces (`bf16_pieces`),
// which hold every bit of a float32: each piece meets the same exact bfloat16 row, so
// the scores and sums are float32 ones. A float16 query takes 2 (all of its 11 bits), as
// do the probabilities for a float16 output (16 bits, 5 more than it keeps).

// Lane i of the result is the sum of the 16 lanes of v[i] (16 horizontal sums in 45
// shuffles and adds instead of about 130). Always inlined: as a call (which GCC chose
// once the kernel had more instances) its 16 vectors went through memory, and the
// bfloat16 decode took a tenth longer.
[[gnu::always_inline]] inline __m512 reduce16(const __m512* v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: pairs of partial sums of v[2i], v[2i+1]
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: sums of 4 vectors' elements there
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    // across the four 128-bit lanes: u[k] holds vectors 4k..4k+3
    const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                    _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                    _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xdd));
}

// Bfloat16 pieces that carry a QT value without loss (see above): a bfloat16 is itself,
// float16's 11 significant bits take 2, float32's 24 take 3.
template <int QT>
constexpr int bf16_pieces() {
    return QT == BF16 ? 1 : (QT == F16 ? 2 : 3);
}

// x as P bfloat16 pieces (pieces[j * stride]) whose sum is x: each piece is what the
// pieces before it left over, rounded to bfloat16 (that remainder is exact in float32).
template <int P>
inline void split_bf16(float x, uint16_t* pieces, int stride) {
    for (int j = 0; j < P; ++j) {
        pieces[j * stride] = f32_to_bf16(x);
        x -= bf16_to_f32(pieces[j * stride]);
    }
}

template <int P>
inline void split_bf16x16(__m512 x, uint16_t* pieces, int stride) {
    for (int j = 0; j < P; ++j) {
        const __m256i piece = (__m256i)_mm512_cvtneps_pbh(x);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pieces + j * stride), piece);
        if (j + 1 < P)
            x = _mm512_sub_ps(x, _mm512_castsi512_ps(
                                     _mm512_slli_epi32(_mm512_cvtepu16_epi32(piece), 16)));
    }
}

// 32 elements of a KT row from element i as bfloat16: a bfloat16 row's as stored, an
// int8 row's converted (exact: every int8 value is a bfloat16 one).
template <int KT>
inline __m512i bf16x32_load(const void* row, int64_t i) {
    if constexpr (KT == I8) {
        const __m128i* x = reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(row) + i);
        const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(x)));
        const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(x + 1)));
        return (__m512i)_mm512_cvtne2ps_pbh(second, first);
    } else {
        return _mm512_loadu_si512(static_cast<const uint16_t*>(row) + i);
    }
}

// Rows [lo, hi) of an int8 block (rows `stride` elements apart) as bfloat16, packed D
// apart into dst.
template <int D>
inline void int8_rows_bf16(const int8_t* rows, int64_t stride, int lo, int hi, uint16_t* dst) {
    for (int t = lo; t < hi; ++t)
        for (int i = 0; i < D; i += 32)
            _mm512_storeu_si512(dst + t * D + i, bf16x32_load<I8>(rows + t * stride, i));
}

// One KV head's int8 row scales over a block's rows (scales[first + t * num_kv_heads]),
// times mul, for t in [lo, hi); 0 elsewhere, where a slot's scale may be anything.
inline void block_row_scales(const float* scales, int64_t first, int num_kv_heads, int lo,
                             int hi, int block_size, float mul, float* out) {
    std::fill(out, out + block_size, 0.0f);
    for (int t = lo; t < hi; ++t) out[t] = scales[first + t * num_kv_heads] * mul;
}

// One query head (P pieces of D / 32 vectors, qv[j * D / 32 + c]) against a bfloat16 row.
template <int D, int P>
inline __m512 row_dot(const __m512bh* qv, const uint16_t* kt) {
    __m512 dot = _mm512_setzero_ps();
    for (int c = 0; c < D / 32; ++c) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kt + c * 32);
        for (int j = 0; j < P; ++j) dot = _mm512_dpbf16_ps(dot, qv[j * (D / 32) + c], k);
    }
    return dot;
}

// Scores of one query head against a block's 16 rows (all allocated, masked later by the
// softmax's [lo, hi)), row t's times lane t of row_mul: row_dot per row, then one
// transposed reduction.
template <int D, int P>
inline void block_scores16(const __m512bh* qv, const uint16_t* k_rows, int64_t row_stride,
                           __m512 row_mul, float* sh) {
    __m512 dots[16];
    for (int t = 0; t < 16; ++t) dots[t] = row_dot<D, P>(qv, k_rows + t * row_stride);
    _mm512_storeu_ps(sh, _mm512_mul_ps(reduce16(dots), row_mul));
}

// acc[g] += sum over rows t in [lo, hi) of p[g][t] * V[t] for GB query heads of one KV
// head, two rows at a time with vdpbf16ps: the rows' elements as bfloat16 (KT rows
// `row_stride` elements apart, int8 ones converted as they are read) interleaved in
// pairs (unpacklo/hi) against the pair (p[t], p[t+1]) of each of the head's P bfloat16
// pieces (piece j of head g at p + (g * P + j) * p_stride), float32 accumulation. The
// interleave permutes dimensions: accumulator 2k (lo) / 2k + 1 (hi), lane i, holds
// dimension 32k + 8 (i / 4) + i % 4 (+ 4 for hi); `value_dim_order` undoes it. A row past
// hi is read as zeros (its slot may hold anything). The accumulators stay in registers:
// (GB + 1) * D / 16 of the 32 zmm registers.
template <int KT, int D, int GB, int P>
inline void accumulate_value_pairs(const void* v_rows, int64_t row_stride, const uint16_t* p,
                                   int p_stride, int lo, int hi, float* acc) {
    constexpr int V = D / 16, C = D / 32;
    __m512 a[GB][V];
    for (int g = 0; g < GB; ++g)
        for (int c = 0; c < V; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + c * 16);
    for (int t = lo; t < hi; t += 2) {
        const char* r0 = static_cast<const char*>(v_rows) + t * row_stride * sizeof_dtype<KT>();
        const char* r1 = r0 + row_stride * sizeof_dtype<KT>();
        const bool second = t + 1 < hi;
        __m512i pairs[V];
        for (int k = 0; k < C; ++k) {
            const __m512i x = bf16x32_load<KT>(r0, k * 32);
            const __m512i y = second ? bf16x32_load<KT>(r1, k * 32) : _mm512_setzero_si512();
            pairs[2 * k] = _mm512_unpacklo_epi16(x, y);
            pairs[2 * k + 1] = _mm512_unpackhi_epi16(x, y);
        }
        for (int g = 0; g < GB; ++g) {
            for (int j = 0; j < P; ++j) {
                int32_t pp;  // (p[t], p[t+1]); p[hi] is 0
                std::memcpy(&pp, p + (g * P + j) * p_stride + t, sizeof pp);
                const __m512bh w = (__m512bh)_mm512_set1_epi32(pp);
                for (int c = 0; c < V; ++c)
                    a[g][c] = _mm512_dpbf16_ps(a[g][c], (__m512bh)pairs[c], w);
            }
        }
    }
    for (int g = 0; g < GB; ++g)
        for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + g * D + c * 16, a[g][c]);
}

// Where dimension d of a head sits in accumulate_value_pairs's accumulators.
inline int value_dim_order(int d) {
    const int k = d / 32, r = d % 32, lane = r / 8, hi = (r % 8) / 4;
    return (2 * k + hi) * 16 + 4 * lane + r % 4;
}

// Query heads per accumulate_value_pairs call: as many as leave registers for a row pair.
template <int D>
constexpr int heads_per_pass() {
    constexpr int V = D / 16;
    constexpr int fit = (28 - V) / V;
    return fit < 1 ? 1 : (fit > 8 ? 8 : fit);
}

template <int KT, int D, int P>
inline void accumulate_values_heads(const void* v_rows, int64_t row_stride, const uint16_t* p,
                                    int p_stride, int lo, int hi, float* acc, int heads) {
    constexpr int MAX = heads_per_pass<D>();
    for (int g0 = 0; g0 < heads; g0 += MAX) {
        const uint16_t* pg = p + g0 * P * p_stride;
        float* ag = acc + g0 * D;
        switch (std::min(MAX, heads - g0)) {
#define CADENCE_ACC(N)                                                                          \
    case N:                                                                                     \
        if constexpr (N <= MAX)                                                                 \
            accumulate_value_pairs<KT, D, N, P>(v_rows, row_stride, pg, p_stride, lo, hi, ag); \
        break;
            CADENCE_ACC(1) CADENCE_ACC(2) CADENCE_ACC(3) CADENCE_ACC(4)
            CADENCE_ACC(5) CADENCE_ACC(6) CADENCE_ACC(7) CADENCE_ACC(8)
#undef CADENCE_ACC
        }
    }
}

// online_softmax_block for a 16-row block in registers, which also writes the block's
// probabilities, times v_mul[t] when given (an int8 block's value scales), as P bfloat16
// pieces into pb (piece j at pb + j * pb_stride; zeros outside [lo, hi), entries 16 and
// 17 of each piece 0).
template <int D, int P>
inline void softmax_block16(const float* sc, int lo, int hi, float& m, float& l, float* acc,
                            const float* v_mul, uint16_t* pb, int pb_stride) {
    const __mmask16 valid = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(NEG_INF), valid, sc);
    const float m_new = std::max(m, _mm512_reduce_max_ps(x));
    const float correction = fast_exp(m - m_new);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(x, _mm512_set1_ps(m_new))));
    l = l * correction + _mm512_reduce_add_ps(e);
    m = m_new;
    if (correction != 1.0f) {
        const __m512 c = _mm512_set1_ps(correction);
        for (int i = 0; i < D / 16; ++i)
            _mm512_storeu_ps(acc + i * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + i * 16), c));
    }
    split_bf16x16<P>(v_mul == nullptr ? e : _mm512_mul_ps(e, _mm512_loadu_ps(v_mul)), pb,
                     pb_stride);
    for (int j = 0; j < P; ++j) pb[j * pb_stride + 16] = pb[j * pb_stride + 17] = 0;
}

// A head's probabilities p[lo, hi), times v_mul[t] when given, as P bfloat16 pieces into
// pb (piece j at pb + j * pb_stride), zeros elsewhere (each piece has block_size + 2
// entries so the pair at hi - 1 reads a 0).
template <int P>
inline void probability_pieces(const float* p, const float* v_mul, int lo, int hi,
                               int block_size, uint16_t* pb, int pb_stride) {
    for (int j = 0; j < P; ++j)
        std::fill(pb + j * pb_stride, pb + j * pb_stride + block_size + 2, uint16_t{0});
    for (int t = lo; t < hi; ++t)
        split_bf16<P>(v_mul == nullptr ? p[t] : p[t] * v_mul[t], pb + t, pb_stride);
}

// decode_seq_dpbf16's per-thread scratch: its layout over one float buffer, and its size.
struct Dpbf16Scratch {
    float* acc;      // [H, D] value_dim_order
    float* s;        // [H, block_size] scores, then probabilities
    float* m;        // [H] running max
    float* l;        // [H] running sum
    float* row;      // [D] an output row
    float* k_mul;    // [block_size] an int8 block's key scales times the softmax scale
    float* v_mul;    // [block_size] an int8 block's value scales
    uint16_t* q;     // [H, P, D] the queries' bfloat16 pieces
    uint16_t* pb;    // [H, P, block_size + 2] the probabilities' pieces
    uint16_t* keys;  // [block_size, D] an int8 block's keys as bfloat16

    static int64_t halves(int H, int D, int block_size, int P) {
        return static_cast<int64_t>(H) * P * (D + block_size + 2) + block_size * D;
    }
    static int64_t floats(int H, int D, int block_size, int P) {
        return static_cast<int64_t>(H) * (D + block_size + 2) + D + 2 * block_size +
               (halves(H, D, block_size, P) + 1) / 2;
    }
    // inlined, so the pointers stay in registers rather than in a struct a call saw
    [[gnu::always_inline]] Dpbf16Scratch(float* base, int H, int D, int block_size, int P) {
        acc = base;
        s = acc + H * D;
        m = s + H * block_size;
        l = m + H;
        row = l + H;
        k_mul = row + D;
        v_mul = k_mul + block_size;
        q = reinterpret_cast<uint16_t*>(v_mul + block_size);
        pb = q + H * P * D;
        keys = pb + H * P * (block_size + 2);
    }
};

// Every query head of a sequence as P bfloat16 pieces (head h's piece j at qp + (h * P + j)
// * D); row is D floats of scratch.
template <int QT, int P>
void query_pieces(const void* q, int64_t seq, int num_heads, int D, float* row, uint16_t* qp) {
    for (int h = 0; h < num_heads; ++h) {
        load_row<QT>(q, (seq * num_heads + h) * D, row, D);
        for (int d = 0; d < D; ++d) split_bf16<P>(row[d], qp + h * P * D + d, D);
    }
}

// A slice of the next block's keys and values (`bytes` of each from byte offset `at`),
// so one query head's work asks for its share: no burst of misses at the block's start.
inline void prefetch_share(const void* k_cache, const void* v_cache, int64_t at, int64_t bytes) {
    prefetch_block(static_cast<const char*>(k_cache) + at, bytes);
    prefetch_block(static_cast<const char*>(v_cache) + at, bytes);
}

// A bfloat16 (QT = BF16) or int8 cache, queries and output of QT (see above).
template <int QT, int KT, int D>
void decode_seq_dpbf16(const void* q, void* out, const void* k_cache, const void* v_cache,
                       const float* k_scale, const float* v_scale, const int64_t* table,
                       int64_t context_len, int64_t seq, int num_heads, int num_kv_heads,
                       int block_size, float scale, int64_t window, float* scratch) {
    constexpr int P = bf16_pieces<QT>(), C = D / 32;
    constexpr bool int8 = KT == I8;
    const int G = num_heads / num_kv_heads;
    const int pb_stride = block_size + 2;
    Dpbf16Scratch w(scratch, num_heads, D, block_size, P);
    query_pieces<QT, P>(q, seq, num_heads, D, w.row, w.q);
    std::fill(w.acc, w.acc + num_heads * D, 0.0f);
    std::fill(w.m, w.m + num_heads, NEG_INF);
    std::fill(w.l, w.l + num_heads, 0.0f);
    const float* v_mul = int8 ? w.v_mul : nullptr;
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
    const int64_t row_stride = static_cast<int64_t>(num_kv_heads) * D;
    const int64_t block_bytes = block_size * row_stride * sizeof_dtype<KT>();
    const int64_t share = (block_bytes + num_heads - 1) / num_heads;
    const int64_t num_blocks = (context_len + block_size - 1) / block_size;
    for (int64_t b = first_key / block_size; b < num_blocks; ++b) {
        const int64_t base = table[b] * block_size;
        const int lo = static_cast<int>(std::max<int64_t>(0, first_key - b * block_size));
        const int hi = static_cast<int>(std::min<int64_t>(block_size, context_len - b * block_size));
        const int64_t next = b + 1 < num_blocks ? table[b + 1] : -1;
        if (int8 && next >= 0) {  // the next block's scales: a line or a few of each
            const int64_t at = next * block_size * num_kv_heads * 4;
            prefetch_share(k_scale, v_scale, at, block_size * num_kv_heads * 4);
        }
        for (int kh = 0; kh < num_kv_heads; ++kh) {
            const int64_t at = base * row_stride + kh * D;  // the head's first row, in elements
            const uint16_t* k_rows = static_cast<const uint16_t*>(k_cache) + at;
            int64_t stride = row_stride;
            __m512 row_mul = _mm512_set1_ps(scale);  // each score's factor, 16 rows
            if constexpr (int8) {  // the 16-row scores read every row of the block
                const auto* k8 = static_cast<const int8_t*>(k_cache) + at;
                int8_rows_bf16<D>(k8, row_stride, block_size == 16 ? 0 : lo,
                                  block_size == 16 ? 16 : hi, w.keys);
                const int64_t first = base * num_kv_heads + kh;
                block_row_scales(k_scale, first, num_kv_heads, lo, hi, block_size, scale, w.k_mul);
                block_row_scales(v_scale, first, num_kv_heads, lo, hi, block_size, 1.0f, w.v_mul);
                k_rows = w.keys;
                stride = D;
                if (block_size == 16) row_mul = _mm512_loadu_ps(w.k_mul);
            }
            for (int g = 0; g < G; ++g) {
                const int h = kh * G + g;
                __m512bh qv[P * C];
                for (int i = 0; i < P * C; ++i)
                    qv[i] = (__m512bh)_mm512_loadu_si512(w.q + h * P * D + i * 32);
                float* sh = w.s + h * block_size;
                uint16_t* ph = w.pb + h * P * pb_stride;
                if (next >= 0)
                    prefetch_share(k_cache, v_cache, next * block_bytes + h * share,
                                   std::min(share, block_bytes - h * share));
                if (block_size == 16) {
                    block_scores16<D, P>(qv, k_rows, stride, row_mul, sh);
                    softmax_block16<D, P>(sh, lo, hi, w.m[h], w.l[h], w.acc + h * D, v_mul, ph,
                                          pb_stride);
                } else {
                    for (int t = lo; t < hi; ++t)
                        sh[t] = _mm512_reduce_add_ps(row_dot<D, P>(qv, k_rows + t * stride)) *
                                (int8 ? w.k_mul[t] : scale);
                    online_softmax_block(sh, lo, hi, w.m[h], w.l[h], w.acc + h * D, D);
                    probability_pieces<P>(sh, v_mul, lo, hi, block_size, ph, pb_stride);
                }
            }
            const void* v_rows = static_cast<const char*>(v_cache) + at * sizeof_dtype<KT>();
            accumulate_values_heads<KT, D, P>(v_rows, row_stride, w.pb + kh * G * P * pb_stride,
                                              pb_stride, lo, hi, w.acc + kh * G * D, G);
        }
    }
    for (int h = 0; h < num_heads; ++h) {
        const float inv = w.l[h] > 0.0f ? 1.0f / w.l[h] : 0.0f;  // no visible key: zeros
        for (int d = 0; d < D; ++d) w.row[d] = w.acc[h * D + value_dim_order(d)];
        store_row<QT>(out, (seq * num_heads + h) * D, w.row, inv, D);
    }
}

// The pairs decode_seq_dpbf16 serves: a bfloat16 cache read by bfloat16 queries, and an
// int8 cache read by any query dtype.
template <int QT, int KT>
constexpr bool dpbf16_serves() {
    return KT == I8 || (QT == BF16 && KT == BF16);
}

template <int QT, int KT>
DecodeSeqFn pick_dpbf16(int head_dim) {
    return for_head_dim<DecodeSeqFn, 32, 64, 96, 128, 256>(
        head_dim, [](auto d) { return decode_seq_dpbf16<QT, KT, decltype(d)::value>; });
}
#endif

}  // namespace
