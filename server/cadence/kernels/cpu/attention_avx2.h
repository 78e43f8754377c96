// The AVX2 decode attention of attention_kernels.cpp (the avx2 and avx512 builds): a
// whole sequence per call (attention_shared.h), any query and cache dtype.

#pragma once

#include "cache_rows.h"
#include "cpu_elements.h"
#include "attention_shared.h"
#include "fast_exp.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace cadence_kernels;  // DType, Status

#ifdef CADENCE_AVX2
// ---- decode attention in 8 float32 lanes (AVX2 + FMA + F16C) ----------------------------
// Any query and cache dtype (the path of the float32 servers below AVX512-BF16), head_dim
// D a multiple of 16, block_size a multiple of 8: one sequence, all of its KV heads, so
// each cache block is read front to back once. Keys and values are read in place and
// converted in registers; each query head scores 8 rows at a time with one accumulator
// per row and a single transposed reduction, and each head accumulates its D dimensions
// in registers. A float cache's softmax is one pass over all of a sequence's scores
// (decode_seq_two_pass); an int8 cache's is a step per block (the online loop).

// Asks for cache lines ahead of use: blocks sit anywhere in the pool, so the hardware
// prefetcher only finds each one after its start (and stops at every 4 KiB page). Into
// L2 (prefetcht1): prefetcht0's fills wait for L1's few miss buffers, and a block's worth
// of them held up the loads of the block at hand (decode attention over blocks spread
// over the pool: bfloat16 cache 1.15-1.35x as long with prefetcht0, Zen 4).
inline void prefetch_block(const void* rows, int64_t bytes) {
    const char* p = static_cast<const char*>(rows);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// The next block's keys and values (`bytes` at byte offset `at` of each cache), asked for
// a slice at a time over the current block's work: prefetched in one burst, its misses
// held this block's loads behind them (a third slower with a float32 cache).
struct BlockPrefetch {
    const char* k;
    const char* v;
    int64_t at, bytes, slice, done = 0;
    void next_slice() {
        const int64_t n = std::min(slice, bytes - done);
        if (n <= 0) return;
        prefetch_block(k + at + done, n);
        prefetch_block(v + at + done, n);
        done += n;
    }
    void rest() {
        while (done < bytes) next_slice();
    }
};

// Elements [i, i + 16) of a row as two float32 vectors: in order, except for bfloat16,
// where a shift and a mask of the same 32-bit lanes give the even elements, then the odd
// ones (no widening shuffle). Queries and accumulators are kept in this order
// (pair order, to_pair_order): dot products and sums do not care.
template <int DT>
inline void load16(const void* p, int64_t i, __m256& a, __m256& b) {
    if constexpr (DT == F32) {
        a = _mm256_loadu_ps(static_cast<const float*>(p) + i);
        b = _mm256_loadu_ps(static_cast<const float*>(p) + i + 8);
    } else if constexpr (DT == BF16) {
        const __m256i x = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
        a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
        b = _mm256_castsi256_ps(_mm256_and_si256(x, high));
    } else if constexpr (DT == F16) {
        const auto* h = reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i);
        a = _mm256_cvtph_ps(_mm_loadu_si128(h));
        b = _mm256_cvtph_ps(_mm_loadu_si128(h + 1));
    } else if constexpr (DT == I8) {  // the stored integers; the caller applies the scales
        const __m128i x = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(p) + i));
        a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
        b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
    } else {  // fp8 as half (fp8_to_f32's bits, before FP8_UNIT and the scale)
        const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(p) + i)));
        __m256i h;
        if constexpr (DT == F8E4M3) {
            const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
            const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7);
            h = _mm256_or_si256(sign, rest);
        } else {
            h = _mm256_slli_epi16(x, 8);
        }
        a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    }
}

// dst[0, D) = row * mul in load16's order for DT (the pair order: for bfloat16, element i
// of each 16 at i % 2 * 8 + i / 2; else in place), and its inverse (from_pair_order): by
// shuffles, where a scalar loop over each element's place had cost a prompt's attention
// about 7% (3 prompts of 320 tokens, one thread of a Zen 3: 321-343 -> 300-308 ms).
template <int DT, int D>
inline void to_pair_order(const float* row, float mul, float* dst) {
    const __m256 m = _mm256_set1_ps(mul);
    for (int c = 0; c < D; c += 16) {
        __m256 a = _mm256_loadu_ps(row + c), b = _mm256_loadu_ps(row + c + 8);
        if constexpr (DT == BF16) {  // evens then odds of each 16
            const __m256 even = _mm256_shuffle_ps(a, b, 0x88), odd = _mm256_shuffle_ps(a, b, 0xdd);
            a = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xd8));
            b = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xd8));
        }
        _mm256_storeu_ps(dst + c, _mm256_mul_ps(a, m));
        _mm256_storeu_ps(dst + c + 8, _mm256_mul_ps(b, m));
    }
}

template <int DT, int D>
inline void from_pair_order(const float* src, float* row) {
    for (int c = 0; c < D; c += 16) {
        __m256 a = _mm256_loadu_ps(src + c), b = _mm256_loadu_ps(src + c + 8);
        if constexpr (DT == BF16) {
            const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
            a = _mm256_permute2f128_ps(lo, hi, 0x20);
            b = _mm256_permute2f128_ps(lo, hi, 0x31);
        }
        _mm256_storeu_ps(row + c, a);
        _mm256_storeu_ps(row + c + 8, b);
    }
}

// Lane i of the result is the sum of the 8 lanes of v[i].
inline __m256 reduce8(const __m256* v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
}

inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

// One query head (qf, in pair order) against 8 rows of KT elements `stride` apart.
template <int KT, int D>
inline __m256 scores8(const float* qf, const void* k, int64_t at, int64_t stride) {
    __m256 dot[8];
    for (int r = 0; r < 8; ++r) dot[r] = _mm256_setzero_ps();
    for (int c = 0; c < D; c += 16) {
        const __m256 qa = _mm256_loadu_ps(qf + c), qb = _mm256_loadu_ps(qf + c + 8);
        for (int r = 0; r < 8; ++r) {
            __m256 ka, kb;
            load16<KT>(k, at + r * stride + c, ka, kb);
            dot[r] = _mm256_fmadd_ps(qb, kb, _mm256_fmadd_ps(qa, ka, dot[r]));
        }
    }
    return reduce8(dot);
}

// online_softmax_block for the n query heads of a KV head (scores sc + i * stride), one
// step at a time over all of them so that their latency chains overlap: whole groups of
// 8 scores, rows outside [lo, hi) made -inf by a select whatever their slot held (NaN
// included), so they weigh exactly 0. correction[i] gets the factor head i's accumulator
// is rescaled by, which accumulate_values16 applies.
inline void softmax_heads8(float* sc, int stride, int n, int lo, int hi, float* m, float* l,
                           float* correction) {
    const int first = lo / 8 * 8;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < n; ++i) {
        float* si = sc + i * stride;
        __m256 top = _mm256_set1_ps(NEG_INF);
        for (int t = first; t < hi; t += 8) {
            const __m256i row = _mm256_add_epi32(lane, _mm256_set1_epi32(t));
            const __m256i valid =
                _mm256_and_si256(_mm256_cmpgt_epi32(row, _mm256_set1_epi32(lo - 1)),
                                 _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), row));
            const __m256 x = _mm256_blendv_ps(_mm256_set1_ps(NEG_INF), _mm256_loadu_ps(si + t),
                                              _mm256_castsi256_ps(valid));
            _mm256_storeu_ps(si + t, x);
            top = _mm256_max_ps(top, x);
        }
        const float m_new = std::max(m[i], hmax8(top));
        correction[i] = fast_exp(m[i] - m_new);
        m[i] = m_new;
    }
    for (int i = 0; i < n; ++i) {
        float* si = sc + i * stride;
        const __m256 mv = _mm256_set1_ps(m[i]);
        __m256 sum = _mm256_setzero_ps();
        for (int t = first; t < hi; t += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(si + t), mv));
            _mm256_storeu_ps(si + t, p);
            sum = _mm256_add_ps(sum, p);
        }
        l[i] = l[i] * correction[i] + hsum8(sum);
    }
}

// acc[0, 16N) = acc * correction + sum over rows t in [lo, hi) of p[t] * v[t] (KT rows
// `stride` apart, acc in pair order), in 2N registers. Rows past hi are never read.
template <int KT, int N>
inline void accumulate_values16(const void* v, int64_t at, int64_t stride, const float* p,
                                int lo, int hi, float correction, float* acc) {
    __m256 a[2 * N];
    const __m256 c = _mm256_set1_ps(correction);
    for (int i = 0; i < 2 * N; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * i), c);
    for (int t = lo; t < hi; ++t) {
        const __m256 pt = _mm256_broadcast_ss(p + t);
        for (int i = 0; i < N; ++i) {
            __m256 va, vb;
            load16<KT>(v, at + t * stride + 16 * i, va, vb);
            a[2 * i] = _mm256_fmadd_ps(pt, va, a[2 * i]);
            a[2 * i + 1] = _mm256_fmadd_ps(pt, vb, a[2 * i + 1]);
        }
    }
    for (int i = 0; i < 2 * N; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

// 16-element chunks per accumulate_values16 pass over a head of D: the most, up to 5,
// that split D / 16 evenly (8 to 10 chains of FMAs keep both FMA ports busy).
template <int D>
constexpr int value_chunks() {
    int n = 5;
    while ((D / 16) % n != 0) --n;
    return n;
}

// Rows [from, to) of an int8 block (one KV head's, `stride` apart from `at`) times their
// per-row scales (`scales[t * scale_stride]`), as float32 rows of D in `out`: each query
// head of the group then reads them as a float32 cache. Widened once for the G heads
// instead of once per head, where the widening cost more than the products (a decode step's
// attention with every block in cache, 2-core Zen 3: 28 ms for an int8 cache widened per
// head against 16 for a float32 cache).
template <int D>
inline void scaled_rows_i8(const void* cache, int64_t at, int64_t stride, const float* scales,
                           int scale_stride, int from, int to, float* out) {
    for (int t = from; t < to; ++t) {
        const __m256 s = _mm256_set1_ps(scales[static_cast<int64_t>(t) * scale_stride]);
        for (int d = 0; d < D; d += 16) {
            __m256 a, b;
            load16<I8>(cache, at + t * stride + d, a, b);
            _mm256_storeu_ps(out + t * D + d, _mm256_mul_ps(a, s));
            _mm256_storeu_ps(out + t * D + d + 8, _mm256_mul_ps(b, s));
        }
    }
}

// The rows of KV head kh in block `block` (block_size rows of D elements, row_stride
// apart), asked for into L2 while the block before is worked on.
template <int KT, int D>
inline void prefetch_head_rows(const void* cache, int64_t block, int kh, int block_size,
                               int64_t row_stride) {
    constexpr int64_t bytes = D * sizeof_dtype<KT>();
    const char* p = static_cast<const char*>(cache) +
                    (block * block_size * row_stride + kh * D) * sizeof_dtype<KT>();
    for (int t = 0; t < block_size; ++t)
        for (int64_t off = 0; off < bytes; off += 64)
            _mm_prefetch(p + t * row_stride * sizeof_dtype<KT>() + off, _MM_HINT_T1);
}

// Scores [t0, t1) of one head turned in place into exp(score - max); returns their sum.
inline float softmax_span(float* sh, int64_t t0, int64_t t1) {
    __m256 top8 = _mm256_set1_ps(NEG_INF);
    int64_t t = t0;
    for (; t + 8 <= t1; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(sh + t));
    float top = hmax8(top8);
    for (; t < t1; ++t) top = std::max(top, sh[t]);
    const __m256 mv = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    for (t = t0; t + 8 <= t1; t += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), mv));
        _mm256_storeu_ps(sh + t, p);
        sum8 = _mm256_add_ps(sum8, p);
    }
    float sum = hsum8(sum8);
    for (; t < t1; ++t) {
        sh[t] = fast_exp(sh[t] - top);
        sum += sh[t];
    }
    return sum;
}

// A float cache's attention in two passes: every key's score first (into a per-thread
// buffer of the sequence's scores), one softmax over them all, then the values; the online
// loop below instead takes a softmax step and rescales the accumulators block by block. On
// a 2-core Zen 3, the two libraries alternated call by call (ab_paired.py): a prompt's
// attention (3 x 320 tokens, each a query over the prompt up to itself) 0.88-0.90 of the
// online loop's time, a decode step's (32 sequences of ~420 keys in scattered blocks)
// 0.89-0.94 on 2 threads (1.01-1.06 on one). Each block's rows of the next block are
// prefetched per KV head: without it decode took 1.2-1.9x as long, and with the online
// loop's slices per score group the prompts lost their gain. An int8 cache keeps the
// online loop, which scales each block's rows once per KV head.
template <int QT, int KT, int D>
void decode_seq_two_pass(const void* k_cache, const void* v_cache, const int64_t* table,
                         int64_t first_key, int64_t context_len, int num_heads, int G,
                         int num_kv_heads, int block_size, const float* qf, float* acc,
                         float* l) {
    constexpr int N = value_chunks<D>();
    const int64_t row_stride = static_cast<int64_t>(num_kv_heads) * D;
    const int64_t num_blocks = (context_len + block_size - 1) / block_size;
    const int64_t width = num_blocks * block_size;  // head h's scores at s + h * width
    static thread_local std::vector<float> scores;
    if (static_cast<int64_t>(scores.size()) < num_heads * width) scores.resize(num_heads * width);
    float* s = scores.data();
    const int64_t b0 = first_key / block_size;
    // Calls body(b, lo, hi, at, kh) for each block b and KV head kh of the sequence: rows
    // [lo, hi) of the block hold keys, `at` is head kh's first row in the cache; the next
    // block's rows of that head are asked for first.
    const auto each_head_block = [&](const void* cache, auto&& body) {
        for (int64_t b = b0; b < num_blocks; ++b) {
            const int lo = static_cast<int>(std::max<int64_t>(0, first_key - b * block_size));
            const int hi =
                static_cast<int>(std::min<int64_t>(block_size, context_len - b * block_size));
            const int64_t base = table[b] * block_size * row_stride;
            for (int kh = 0; kh < num_kv_heads; ++kh) {
                if (b + 1 < num_blocks)
                    prefetch_head_rows<KT, D>(cache, table[b + 1], kh, block_size, row_stride);
                body(b, lo, hi, base + kh * D, kh);
            }
        }
    };
    each_head_block(k_cache, [&](int64_t b, int lo, int hi, int64_t at, int kh) {
        for (int h = kh * G; h < (kh + 1) * G; ++h)  // scores, in whole groups of 8 rows
            for (int t = lo / 8 * 8; t < hi; t += 8)
                _mm256_storeu_ps(s + h * width + b * block_size + t,
                                 scores8<KT, D>(qf + h * D, k_cache, at + t * row_stride,
                                                row_stride));
    });
    if (b0 < num_blocks)  // the values' first block, while the softmax runs
        for (int kh = 0; kh < num_kv_heads; ++kh)
            prefetch_head_rows<KT, D>(v_cache, table[b0], kh, block_size, row_stride);
    for (int h = 0; h < num_heads; ++h)
        l[h] = softmax_span(s + h * width, first_key, context_len);
    each_head_block(v_cache, [&](int64_t b, int lo, int hi, int64_t at, int kh) {
        for (int h = kh * G; h < (kh + 1) * G; ++h)
            for (int c = 0; c < D; c += 16 * N)
                accumulate_values16<KT, N>(v_cache, at + c, row_stride,
                                           s + h * width + b * block_size, lo, hi, 1.0f,
                                           acc + h * D + c);
    });
}

// One query row's state in an int8 cache's online loop, laid out one after another in a
// scratch of row_floats(H, D): its queries times scale and its accumulators ([H, D] each,
// pair order), then the running max, running sum and this block's rescaling ([H] each).
struct OnlineRowI8 {
    float *qf, *acc, *m, *l, *correction;
    static int64_t row_floats(int num_heads, int head_dim) {
        return static_cast<int64_t>(num_heads) * (2 * head_dim + 3);
    }
    static OnlineRowI8 at(float* p, int num_heads, int head_dim) {
        const int64_t hd = static_cast<int64_t>(num_heads) * head_dim;
        return {p, p + hd, p + 2 * hd, p + 2 * hd + num_heads, p + 2 * hd + 2 * num_heads};
    }
    // Query row `seq` of q (QT) times scale, in pair order, with nothing seen yet (`row`:
    // D floats of scratch).
    template <int QT, int D>
    void start(const void* q, int64_t seq, int num_heads, float scale, float* row) const {
        for (int h = 0; h < num_heads; ++h) {
            load_row<QT>(q, (seq * num_heads + h) * D, row, D);
            to_pair_order<F32, D>(row, scale, qf + h * D);
        }
        std::fill(acc, acc + num_heads * D, 0.0f);
        std::fill(m, m + num_heads, NEG_INF);
        std::fill(l, l + num_heads, 0.0f);
    }
    // Its output rows: the accumulators over the sum (zeros where no key was visible).
    template <int QT, int D>
    void finish(void* out, int64_t seq, int num_heads, float* row) const {
        for (int h = 0; h < num_heads; ++h) {
            const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
            from_pair_order<F32, D>(acc + h * D, row);
            store_row<QT>(out, (seq * num_heads + h) * D, row, inv, D);
        }
    }
};

// One block's step of the online loop for one row and the G query heads of KV head kh:
// the block's rows [lo, hi) of that head scaled into kf and vf ([block_size, D] each,
// scaled_rows_i8; the keys' rows in whole groups of 8, those outside [lo, hi) masked by the
// softmax's select whatever they hold), scores into s ([H, block_size]), softmax_heads8,
// then the values with the correction. `next` (decode_seq_avx2's prefetch of the next
// block; null in decode_rows_avx2_i8) takes a slice before each score group and each
// head's values. Both int8 kernels take a row's steps here, so its bits are the same
// whichever serves it: the same operations, none of them fused by the compiler in one
// kernel and not in the other (cpu_builds.py builds with -ffp-contract=off).
template <int D>
inline void online_block_i8(const OnlineRowI8& r, const float* kf, const float* vf, float* s,
                            int block_size, int G, int kh, int lo, int hi, BlockPrefetch* next) {
    constexpr int N = value_chunks<D>();
    for (int h = kh * G; h < (kh + 1) * G; ++h)
        for (int t = lo / 8 * 8; t < hi; t += 8) {
            if (next) next->next_slice();
            _mm256_storeu_ps(s + h * block_size + t, scores8<F32, D>(r.qf + h * D, kf, t * D, D));
        }
    softmax_heads8(s + kh * G * block_size, block_size, G, lo, hi, r.m + kh * G, r.l + kh * G,
                   r.correction + kh * G);
    for (int h = kh * G; h < (kh + 1) * G; ++h) {
        if (next) next->next_slice();
        for (int c = 0; c < D; c += 16 * N)
            accumulate_values16<F32, N>(vf, c, D, s + h * block_size, lo, hi, r.correction[h],
                                        r.acc + h * D + c);
    }
}

// decode_seq_avx2's scratch: a row's state (OnlineRowI8's layout; a float cache reads its
// qf, acc and l), the scores of one block, a row buffer, an int8 block's scaled rows.
inline int64_t avx2_seq_floats(int head_dim, int num_heads, int block_size) {
    return OnlineRowI8::row_floats(num_heads, head_dim) +
           static_cast<int64_t>(num_heads) * block_size + head_dim +
           2 * static_cast<int64_t>(block_size) * head_dim;
}

// One sequence. A float cache takes two passes (decode_seq_two_pass); an int8 cache the
// online loop, a softmax step per block, its rows scaled once per KV head into float32
// (scaled_rows_i8), as the reference reads them. fp8's layer scales fold into the query
// (keys) and the final 1 / sum (values).
template <int QT, int KT, int D>
void decode_seq_avx2(const void* q, void* out, const void* k_cache, const void* v_cache,
                     const float* k_scale, const float* v_scale, const int64_t* table,
                     int64_t context_len, int64_t seq, int num_heads, int num_kv_heads,
                     int block_size, float scale, int64_t window, float* scratch) {
    const int G = num_heads / num_kv_heads;
    const OnlineRowI8 state = OnlineRowI8::at(scratch, num_heads, D);
    float* s = scratch + OnlineRowI8::row_floats(num_heads, D);  // [H, block_size]
    float* row = s + num_heads * block_size;                     // [D]
    float* kf = row + D;                        // [block_size, D] an int8 block's keys
    float* vf = kf + block_size * D;            // [block_size, D] and values, scaled
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
    if constexpr (KT != I8) {
        constexpr bool per_layer = KT == F8E4M3 || KT == F8E5M2;
        const float q_mul = per_layer ? scale * k_scale[0] * FP8_UNIT<KT> : scale;
        const float out_mul = per_layer ? v_scale[0] * FP8_UNIT<KT> : 1.0f;
        for (int h = 0; h < num_heads; ++h) {
            load_row<QT>(q, (seq * num_heads + h) * D, row, D);
            to_pair_order<KT, D>(row, q_mul, state.qf + h * D);
        }
        std::fill(state.acc, state.acc + num_heads * D, 0.0f);
        std::fill(state.l, state.l + num_heads, 0.0f);
        decode_seq_two_pass<QT, KT, D>(k_cache, v_cache, table, first_key, context_len,
                                       num_heads, G, num_kv_heads, block_size, state.qf,
                                       state.acc, state.l);
        for (int h = 0; h < num_heads; ++h) {
            const float inv = state.l[h] > 0.0f ? out_mul / state.l[h] : 0.0f;  // no key: zeros
            from_pair_order<KT, D>(state.acc + h * D, row);
            store_row<QT>(out, (seq * num_heads + h) * D, row, inv, D);
        }
    } else {
        state.start<QT, D>(q, seq, num_heads, scale, row);
        const int64_t row_stride = static_cast<int64_t>(num_kv_heads) * D;
        const int64_t block_bytes = block_size * row_stride;  // int8
        const int64_t slices = num_heads * (block_size / 8 + 1);  // score groups, value passes
        const int64_t slice = ((block_bytes + slices - 1) / slices + 63) / 64 * 64;
        const int64_t num_blocks = (context_len + block_size - 1) / block_size;
        for (int64_t b = first_key / block_size; b < num_blocks; ++b) {
            const int64_t base = table[b] * block_size;
            const int lo = static_cast<int>(std::max<int64_t>(0, first_key - b * block_size));
            const int hi = static_cast<int>(std::min<int64_t>(block_size, context_len - b * block_size));
            const bool last = b + 1 == num_blocks;
            BlockPrefetch next{static_cast<const char*>(k_cache), static_cast<const char*>(v_cache),
                               last ? 0 : table[b + 1] * block_bytes, last ? 0 : block_bytes, slice};
            for (int kh = 0; kh < num_kv_heads; ++kh) {
                const int64_t at = base * row_stride + kh * D;
                scaled_rows_i8<D>(k_cache, at, row_stride, k_scale + base * num_kv_heads + kh,
                                  num_kv_heads, lo / 8 * 8, (hi + 7) / 8 * 8, kf);
                scaled_rows_i8<D>(v_cache, at, row_stride, v_scale + base * num_kv_heads + kh,
                                  num_kv_heads, lo, hi, vf);
                online_block_i8<D>(state, kf, vf, s, block_size, G, kh, lo, hi, &next);
            }
            next.rest();  // what a partial block's fewer passes left over
        }
        state.finish<QT, D>(out, seq, num_heads, row);
    }
}

// The most query rows decode_rows_avx2_i8 takes together: consecutive tokens of one
// prompt chunk, each a query over the context up to itself (batch-invariant prefill).
constexpr int AVX2_I8_GROUP_ROWS = 16;

// decode_rows_avx2_i8's scratch: shared by its rows (a row buffer, a block's scaled key
// and value rows of one KV head, the scores of the row at hand), then each row's own
// (OnlineRowI8::row_floats). The shared part and one row are decode_seq_avx2's scratch.
inline int64_t avx2_i8_shared_floats(int head_dim, int num_heads, int block_size) {
    return avx2_seq_floats(head_dim, num_heads, block_size) -
           OnlineRowI8::row_floats(num_heads, head_dim);
}

// Up to AVX2_I8_GROUP_ROWS consecutive rows over one block table and an int8 cache, with
// no sliding window (decode_row_groups): each block's rows are scaled into float32 once
// per KV head for every row that sees the block, where decode_seq_avx2 scales them again
// for each row (a prompt of 320 tokens scaled each block up to 320 times: 1.6x the
// bfloat16 cache's attention on a Zen 3). Each row then takes its step in
// online_block_i8, as decode_seq_avx2's rows do, on the same float32 rows, so a row's
// bits do not depend on the rows beside it. One row is decode_seq_avx2 itself.
template <int QT, int D>
void decode_rows_avx2_i8(const void* q, void* out, const void* k_cache, const void* v_cache,
                         const float* k_scale, const float* v_scale, const int64_t* table,
                         const int64_t* context_lens, int64_t seq0, int rows, int num_heads,
                         int num_kv_heads, int block_size, float scale, int64_t window,
                         float* scratch) {
    if (rows == 1)  // the scratch holds decode_seq_avx2's: the shared part and one row's
        return decode_seq_avx2<QT, I8, D>(q, out, k_cache, v_cache, k_scale, v_scale, table,
                                          context_lens[0], seq0, num_heads, num_kv_heads,
                                          block_size, scale, window, scratch);
    const int G = num_heads / num_kv_heads;
    float* row = scratch;                      // [D]
    float* kf = row + D;                       // [block_size, D] a block's keys, scaled
    float* vf = kf + block_size * D;           // [block_size, D] and values
    float* s = vf + block_size * D;            // [H, block_size] the row at hand's scores
    float* own = scratch + avx2_i8_shared_floats(D, num_heads, block_size);
    const auto state = [&](int r) -> OnlineRowI8 {
        return OnlineRowI8::at(own + r * OnlineRowI8::row_floats(num_heads, D), num_heads, D);
    };
    const int64_t row_stride = static_cast<int64_t>(num_kv_heads) * D;
    const int64_t block_bytes = block_size * row_stride;  // int8
    int64_t num_blocks_all = 0;
    for (int r = 0; r < rows; ++r) {
        state(r).template start<QT, D>(q, seq0 + r, num_heads, scale, row);
        num_blocks_all = std::max(num_blocks_all, (context_lens[r] + block_size - 1) / block_size);
    }
    for (int64_t b = 0; b < num_blocks_all; ++b) {
        const int64_t base = table[b] * block_size;
        if (b + 1 < num_blocks_all) {  // the next block, while this one is worked on
            prefetch_block(static_cast<const int8_t*>(k_cache) + table[b + 1] * block_bytes,
                           block_bytes);
            prefetch_block(static_cast<const int8_t*>(v_cache) + table[b + 1] * block_bytes,
                           block_bytes);
        }
        int hi_all = 0;  // the most rows of this block any row sees
        for (int r = 0; r < rows; ++r)
            hi_all = std::max<int>(
                hi_all, static_cast<int>(std::clamp<int64_t>(context_lens[r] - b * block_size, 0,
                                                             block_size)));
        for (int kh = 0; kh < num_kv_heads; ++kh) {
            const int64_t at = base * row_stride + kh * D;
            scaled_rows_i8<D>(k_cache, at, row_stride, k_scale + base * num_kv_heads + kh,
                              num_kv_heads, 0, (hi_all + 7) / 8 * 8, kf);
            scaled_rows_i8<D>(v_cache, at, row_stride, v_scale + base * num_kv_heads + kh,
                              num_kv_heads, 0, hi_all, vf);
            for (int r = 0; r < rows; ++r) {
                const int64_t left = context_lens[r] - b * block_size;
                if (left <= 0) continue;  // a shorter row ends before this block
                const int hi = static_cast<int>(std::min<int64_t>(block_size, left));
                online_block_i8<D>(state(r), kf, vf, s, block_size, G, kh, 0, hi, nullptr);
            }
        }
    }
    for (int r = 0; r < rows; ++r) state(r).template finish<QT, D>(out, seq0 + r, num_heads, row);
}

template <int QT>
DecodeRowsFn pick_rows_avx2_i8(int head_dim, int block_size) {
    if (block_size % 8 != 0) return nullptr;
    return for_head_dim<DecodeRowsFn, 32, 64, 80, 96, 128, 256>(
        head_dim, [](auto d) { return decode_rows_avx2_i8<QT, decltype(d)::value>; });
}

template <int QT, int KT>
DecodeSeqFn pick_avx2(int head_dim, int block_size) {
    if (block_size % 8 != 0) return nullptr;
    return for_head_dim<DecodeSeqFn, 32, 64, 80, 96, 128, 256>(
        head_dim, [](auto d) { return decode_seq_avx2<QT, KT, decltype(d)::value>; });
}
#endif

}  // namespace
