// Greedy sampling with log-probabilities (cadence_greedy_logprobs): the argmax, max and
// log-sum-exp of each row in two passes over the logits instead of a full log_softmax.

#include "cache_rows.h"
#include "cpu_elements.h"
#include "cpu_kernels.h"
#include "fast_exp.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

using namespace cadence_kernels;  // DType, Status

// sum over the row of exp(x - best) (all <= 1): float lanes over chunks of 256, chunks
// added in double, so the error stays that of a float sum of at most 256 terms however
// long the row (a plain float loop over 5k entries drifted by 1e-4 relative).
template <int DT>
double sum_exp_below(const void* x, int64_t at, int64_t vocab, float best) {
    constexpr int64_t CHUNK = 256;
    double total = 0.0;
    for (int64_t lo = 0; lo < vocab; lo += CHUNK) {
        const int64_t hi = std::min(vocab, lo + CHUNK);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = lo; i < hi; ++i) sum += fast_exp(load1<DT>(x, at + i) - best);
        total += sum;
    }
    return total;
}

// The scan of one row that takes any row, including NaN / inf ones: argmax and its
// log-probability, or NaN for a row log_softmax would give NaN.
template <int DT>
void greedy_row_scalar(const void* x, int64_t at, int64_t vocab, int64_t* id, float* logprob) {
    float best = NEG_INF;
    int nan = 0;
    for (int64_t i = 0; i < vocab; ++i) {
        const float v = load1<DT>(x, at + i);
        best = std::max(best, v);
        nan |= v != v;
    }
    int64_t arg = 0;
    if (!nan && std::isfinite(best)) {  // -inf entries are fine: exp gives 0
        while (load1<DT>(x, at + arg) != best) ++arg;
        *logprob = -std::log(sum_exp_below<DT>(x, at, vocab, best));
    } else {
        float top = load1<DT>(x, at);
        for (int64_t i = 1; i < vocab; ++i) {
            const float v = load1<DT>(x, at + i);
            if (std::isnan(top)) break;
            if (std::isnan(v) || v > top) {
                top = v;
                arg = i;
            }
        }
        *logprob = std::numeric_limits<float>::quiet_NaN();
    }
    *id = arg;
}

#ifdef CADENCE_AVX2
// The row's largest value and the first index holding it, 8 lanes at a time: each lane
// keeps its largest value and the first index it was seen at (a strict >), and the
// smallest index among the lanes holding the row's largest is the first one. Returns
// false for a row with a NaN. The scalar search for the index after the maximum had been
// a third of a 32-row step's greedy sampling (a Zen 3; the logits' bits are untouched).
template <int DT>
bool max_and_first(const void* x, int64_t at, int64_t vocab, float& best, int64_t& arg) {
    using Element = std::conditional_t<DT == BF16, uint16_t, float>;
    const Element* row = static_cast<const Element*>(x) + at;
    __m256 top = _mm256_set1_ps(NEG_INF), nan = _mm256_setzero_ps();
    __m256i where = _mm256_setzero_si256(), index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    const int64_t whole = vocab / 8 * 8;
    for (int64_t i = 0; i < whole; i += 8) {
        const __m256 v = load8(row + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 above = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
        top = _mm256_max_ps(v, top);
        where = _mm256_blendv_epi8(where, index, _mm256_castps_si256(above));
        index = _mm256_add_epi32(index, step);
    }
    if (_mm256_movemask_ps(nan) != 0) return false;
    alignas(32) float tops[8];
    alignas(32) int32_t firsts[8];
    _mm256_store_ps(tops, top);
    _mm256_store_si256(reinterpret_cast<__m256i*>(firsts), where);
    best = NEG_INF;
    arg = 0;
    for (int lane = 0; lane < 8; ++lane) {
        if (tops[lane] > best || (tops[lane] == best && firsts[lane] < arg)) {
            best = tops[lane];
            arg = firsts[lane];
        }
    }
    for (int64_t i = whole; i < vocab; ++i) {  // after every lane's index: only a larger one wins
        const float v = load1<DT>(x, at + i);
        if (v != v) return false;
        if (v > best) {
            best = v;
            arg = i;
        }
    }
    return true;
}
#endif

// The same for a row without NaN or +inf, written for the compiler to vectorize (the
// path below AVX512-BF16): false (nothing written) for a row the scan above must take.
template <int DT>
bool greedy_row_lanes(const void* x, int64_t at, int64_t vocab, int64_t* id, float* logprob) {
    float best = NEG_INF;
    int64_t arg = 0;
#ifdef CADENCE_AVX2
    if (!max_and_first<DT>(x, at, vocab, best, arg) || !std::isfinite(best)) return false;
#else
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t i = 0; i < vocab; ++i) {
        const float v = load1<DT>(x, at + i);
        best = std::max(best, v);
        nan |= v != v;
    }
    if (nan || !std::isfinite(best)) return false;
    while (load1<DT>(x, at + arg) != best) ++arg;
#endif
    *id = arg;
    *logprob = -std::log(sum_exp_below<DT>(x, at, vocab, best));
    return true;
}

#ifdef CADENCE_AVX512_BF16
// Lanes [i, i + n) of a row as float32, -inf past its end (n <= 16).
template <int DT>
inline __m512 load_masked16(const void* x, int64_t i, int64_t n) {
    const __mmask16 keep = n >= 16 ? static_cast<__mmask16>(0xffff)
                                   : static_cast<__mmask16>((1u << n) - 1);
    if constexpr (DT == F32) {
        return _mm512_mask_loadu_ps(_mm512_set1_ps(NEG_INF), keep, static_cast<const float*>(x) + i);
    } else {
        const __m256i h = _mm256_mask_loadu_epi16(_mm256_set1_epi16(static_cast<short>(0xff80)),
                                                  keep, static_cast<const uint16_t*>(x) + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
}

// The same row 16 lanes at a time; false (nothing written) when the row holds a NaN or
// +inf or only -inf, which the scalar scan handles.
template <int DT>
bool greedy_row16(const void* x, int64_t at, int64_t vocab, int64_t* id, float* logprob) {
    __m512 top = _mm512_set1_ps(NEG_INF);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < vocab; i += 16) {
        const __m512 v = load_masked16<DT>(x, at + i, vocab - i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, v);
    }
    const float best = _mm512_reduce_max_ps(top);
    if (nan != 0 || !std::isfinite(best)) return false;
    const __m512 vbest = _mm512_set1_ps(best);
    int64_t arg = -1;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < vocab; i += 16) {
        const __m512 v = load_masked16<DT>(x, at + i, vocab - i);
        if (arg < 0) {
            const __mmask16 hit = _mm512_cmp_ps_mask(v, vbest, _CMP_EQ_OQ);
            if (hit != 0) arg = i + __builtin_ctz(hit);
        }
        sum = _mm512_add_ps(sum, exp16(_mm512_sub_ps(v, vbest)));
    }
    *id = arg;
    *logprob = -std::log(_mm512_reduce_add_ps(sum));
    return true;
}
#endif

template <int DT>
void greedy_all(const void* logits, int64_t rows, int64_t vocab, int64_t* ids, float* logprobs,
                int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
#ifdef CADENCE_AVX512_BF16
        if (greedy_row16<DT>(logits, r * vocab, vocab, ids + r, logprobs + r)) continue;
#else
        if (greedy_row_lanes<DT>(logits, r * vocab, vocab, ids + r, logprobs + r)) continue;
#endif
        greedy_row_scalar<DT>(logits, r * vocab, vocab, ids + r, logprobs + r);
    }
}

}  // namespace

extern "C" {

// logits: [rows, vocab] of dtype (float32 or bfloat16). Per row: the argmax (the first
// on ties, as torch's) and its log-probability, -log(sum(exp(x - max))): one pass for the
// max, one for the sum, instead of a whole log_softmax row. A row with a NaN, a +inf, or
// nothing but -inf falls back to a scalar scan and gets a NaN log-probability, as
// log_softmax would give.
int cadence_greedy_logprobs(const void* logits, int64_t rows, int64_t vocab, int64_t* ids,
                            float* logprobs, int dtype, int num_threads) {
    if (dtype == F32) {
        greedy_all<F32>(logits, rows, vocab, ids, logprobs, num_threads);
    } else if (dtype == BF16) {
        greedy_all<BF16>(logits, rows, vocab, ids, logprobs, num_threads);
    } else {
        return BAD_DTYPE;
    }
    return OK;
}

}  // extern "C"
