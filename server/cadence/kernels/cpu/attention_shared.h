// What the decode attention paths of attention_kernels.cpp share: a block's step of the
// online softmax, and the signature of a kernel of one whole sequence, which
// attention_avx2.h and attention_avx512_bf16.h define per dtype pair and head_dim.

#pragma once

#include "fast_exp.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

// One block's step of the online softmax for one query head: scores sc[lo, hi) become
// exp(score - new max) in place, the running max m and sum l are updated, and the
// head's accumulator acc[D] is rescaled for the new max (exp(-inf) = 0 at the start).
inline void online_softmax_block(float* sc, int lo, int hi, float& m, float& l, float* acc,
                                 int D) {
    float block_max = NEG_INF;
    for (int t = lo; t < hi; ++t) block_max = std::max(block_max, sc[t]);
    const float m_new = std::max(m, block_max);
    const float correction = fast_exp(m - m_new);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = lo; t < hi; ++t) {
        const float p = fast_exp(sc[t] - m_new);
        sc[t] = p;
        sum += p;
    }
    l = l * correction + sum;
    m = m_new;
#pragma omp simd
    for (int d = 0; d < D; ++d) acc[d] *= correction;
}

// A kernel of one whole sequence (decode_seq_avx2, decode_seq_dpbf16): q, out, the caches,
// their scales, the sequence's block table, its context length, its index, num_heads,
// num_kv_heads, block_size, scale, window, the calling thread's scratch.
using DecodeSeqFn = void (*)(const void*, void*, const void*, const void*, const float*,
                             const float*, const int64_t*, int64_t, int64_t, int, int, int,
                             float, int64_t, float*);

// A kernel of `rows` consecutive query rows over one block table (decode_rows_int8): q,
// out, the caches, their scales, the rows' block table, their context lengths, the first
// row's index, the number of rows, then as DecodeSeqFn.
using DecodeRowsFn = void (*)(const void*, void*, const void*, const void*, const float*,
                              const float*, const int64_t*, const int64_t*, int64_t, int, int,
                              int, int, float, int64_t, float*);

// The kernel a pick_* function hands out for head_dim: make(std::integral_constant<int, D>{})
// for the D of Ds equal to it, or nullptr where none of Ds is (no kernel built for it).
template <typename Fn, int... Ds, typename Make>
Fn for_head_dim(int head_dim, Make&& make) {
    Fn fn = nullptr;
    (void)((head_dim == Ds && (fn = make(std::integral_constant<int, Ds>{}), true)) || ...);
    return fn;
}

}  // namespace
