// LoRA's two products for a step's rows of many adapters (the decode rows that
// cadence/lora/torch_ops.py groups as `Segments.small_rows`), reading each row's adapter
// matrices in place in the KV pool: the pool read as rows of one width (rows_in [N, in]
// for A, rows_out [N, out] for Bᵀ), an adapter's matrix as the rows its index table names.
// Torch's path gathers every row's matrices into a copy and runs a batched product; here
// each row streams its adapter's rows straight from the pool, once.
//
//   - cadence_lora_shrink: h[t, j] = x[t] · rows_in[a_idx[a, j]] for j < ranks[a] (a the
//     row's adapter), 0 past the rank and on a row of no adapter (-1); float32 sums,
//     rounded once to the dtype;
//   - cadence_lora_expand: y[t, out_offset + c] += sum over j < piece_ranks[a] of
//     h[t, rank_start[a] + j] * rows_out[b_idx[a, j], c], the sum in float32 and added to
//     y's element, rounded once.
//
// A row reads only its adapter's first `rank` indices: padding past the rank is never
// followed. The shim (cpu_ops.cpp) checks every index against the pool before the call.
// With AVX-512 BF16, a bfloat16 shrink's dot products are vdpbf16ps (exact products,
// float32 sums); other shrinks are portable C++ that each build vectorizes for its
// registers. The expand keeps 64 columns of float32 sums in registers, written with
// AVX-512 or AVX2 + FMA intrinsics (the compiler's own vectorization of that loop fell
// back to its scalar version), portable C++ in the scalar build.
//
// One thread per call below PARALLEL_MIN_WORK; above, the rows are split over OpenMP's
// threads (torch's runtime) like the other kernels' rows.

#include "cpu_elements.h"
#include "cpu_kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

using namespace cadence_kernels;  // DType, Status

// The element type of a dtype code, and its value as float32.
template <int DT>
struct Elem;
template <>
struct Elem<F32> {
    using type = float;
};
template <>
struct Elem<BF16> {
    using type = uint16_t;
};
template <>
struct Elem<F16> {
    using type = half_t;
};
template <int DT>
using elem_t = typename Elem<DT>::type;

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return bf16_to_f32(x); }
inline float to_f32(half_t x) { return static_cast<float>(x); }

template <typename T>
inline T from_f32(float f) {
    if constexpr (std::is_same_v<T, uint16_t>) {
        return f32_to_bf16(f);
    } else {
        return static_cast<T>(f);
    }
}

// The rows a call covers: rows[i], or first + i when the selection is one run.
struct Selection {
    const int64_t* rows;
    int64_t first;
    int64_t operator[](int64_t i) const { return rows ? rows[i] : first + i; }
};

// Multiply-adds below which a call stays on its thread: an OpenMP fork costs a few
// microseconds, about what a rank-8 shrink of 16 rows of 576 takes.
constexpr int64_t PARALLEL_MIN_WORK = 1 << 17;

// Dot products of x against the pool rows idx[0, rank), four at a time so each x element
// is loaded once per four rows; h[j] = the rounded sums, 0 for j in [rank, rmax).
// __restrict: the pool and x are only read, so the compiler needs no overlap checks (with
// them it chose the scalar version of the loop).
template <typename T>
void shrink_row(const T* __restrict x, const T* __restrict pool, int64_t in, int64_t stride,
                const int64_t* idx, int64_t rank, T* __restrict h, int64_t rmax) {
    for (int64_t j = 0; j < rank; j += 4) {
        const T* __restrict a0 = pool + idx[j] * stride;  // past the rank: the last real row
        const T* __restrict a1 = pool + idx[std::min(j + 1, rank - 1)] * stride;
        const T* __restrict a2 = pool + idx[std::min(j + 2, rank - 1)] * stride;
        const T* __restrict a3 = pool + idx[std::min(j + 3, rank - 1)] * stride;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t k = 0; k < in; ++k) {
            const float xv = to_f32(x[k]);
            s0 += xv * to_f32(a0[k]);
            s1 += xv * to_f32(a1[k]);
            s2 += xv * to_f32(a2[k]);
            s3 += xv * to_f32(a3[k]);
        }
        const float sums[4] = {s0, s1, s2, s3};
        for (int i = 0; i < 4 && j + i < rank; ++i) h[j + i] = from_f32<T>(sums[i]);
    }
    for (int64_t j = rank; j < rmax; ++j) h[j] = from_f32<T>(0.0f);
}

#ifdef CADENCE_AVX512_BF16
// shrink_row for bfloat16: vdpbf16ps takes 32 elements of x and of a row a step (pairs
// multiplied exactly, summed in float32); a tail under 32 elements is a masked load.
void shrink_row_bf16(const uint16_t* x, const uint16_t* pool, int64_t in, int64_t stride,
                     const int64_t* idx, int64_t rank, uint16_t* h, int64_t rmax) {
    const int64_t whole = in / 32 * 32;
    const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (in - whole)) - 1);
    for (int64_t j = 0; j < rank; j += 4) {
        const uint16_t* a[4];
        for (int i = 0; i < 4; ++i) a[i] = pool + idx[std::min(j + i, rank - 1)] * stride;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        for (int64_t k = 0; k < whole; k += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
            for (int i = 0; i < 4; ++i)
                acc[i] = _mm512_dpbf16_ps(acc[i], xv, (__m512bh)_mm512_loadu_si512(a[i] + k));
        }
        if (tail) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + whole);
            for (int i = 0; i < 4; ++i)
                acc[i] = _mm512_dpbf16_ps(
                    acc[i], xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, a[i] + whole));
        }
        for (int i = 0; i < 4 && j + i < rank; ++i)
            h[j + i] = f32_to_bf16(_mm512_reduce_add_ps(acc[i]));
    }
    for (int64_t j = rank; j < rmax; ++j) h[j] = 0;
}
#endif

template <int DT>
void shrink_all(const void* x_data, int64_t x_stride, const void* pool_data, int64_t in,
                int64_t pool_stride, const int64_t* a_idx, int64_t rmax, const int64_t* ranks,
                const int64_t* row_adapter, Selection rows, int64_t n, void* h_data,
                int num_threads) {
    using T = elem_t<DT>;
    const T* x = static_cast<const T*>(x_data);
    const T* pool = static_cast<const T*>(pool_data);
    T* h = static_cast<T*>(h_data);
    const bool parallel = num_threads > 1 && n * rmax * in >= PARALLEL_MIN_WORK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) {
        const int64_t t = rows[i], a = row_adapter[i];
        const int64_t rank = a < 0 ? 0 : ranks[a];
        const int64_t* idx = a < 0 ? nullptr : a_idx + a * rmax;
#ifdef CADENCE_AVX512_BF16
        if constexpr (DT == BF16) {
            shrink_row_bf16(x + t * x_stride, pool, in, pool_stride, idx, rank, h + t * rmax, rmax);
            continue;
        }
#endif
        shrink_row<T>(x + t * x_stride, pool, in, pool_stride, idx, rank, h + t * rmax, rmax);
    }
}

// Columns of y one pass of expand_row sums: four AVX-512 or eight AVX2 registers of
// float32 accumulators, so four or eight independent multiply-add chains per rank.
constexpr int64_t EXPAND_COLUMNS = 64;

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bfloat16
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline __m512 load16(const half_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc[0, 64) = sum over j < rank of h[j] * b_j[c0, c0 + 64), b_j the pool row idx[j].
template <typename T>
inline void sum_columns(float* acc, const T* h, const T* pool, int64_t stride, int64_t c0,
                        const int64_t* idx, int64_t rank) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    for (int64_t j = 0; j < rank; ++j) {
        const __m512 hj = _mm512_set1_ps(to_f32(h[j]));
        const T* b = pool + idx[j] * stride + c0;
        for (int k = 0; k < 4; ++k) a[k] = _mm512_fmadd_ps(hj, load16(b + 16 * k), a[k]);
    }
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(acc + 16 * k, a[k]);
}
#elif defined(CADENCE_AVX2)
template <typename T>
inline void sum_columns(float* acc, const T* h, const T* pool, int64_t stride, int64_t c0,
                        const int64_t* idx, int64_t rank) {
    __m256 a[8];
    for (int k = 0; k < 8; ++k) a[k] = _mm256_setzero_ps();
    for (int64_t j = 0; j < rank; ++j) {
        const __m256 hj = _mm256_set1_ps(to_f32(h[j]));
        const T* b = pool + idx[j] * stride + c0;
        for (int k = 0; k < 8; ++k) a[k] = _mm256_fmadd_ps(hj, load8(b + 8 * k), a[k]);
    }
    for (int k = 0; k < 8; ++k) _mm256_storeu_ps(acc + 8 * k, a[k]);
}
#else
template <typename T>
inline void sum_columns(float* acc, const T* h, const T* pool, int64_t stride, int64_t c0,
                        const int64_t* idx, int64_t rank) {
    for (int64_t c = 0; c < EXPAND_COLUMNS; ++c) acc[c] = 0.0f;
    for (int64_t j = 0; j < rank; ++j) {
        const float hj = to_f32(h[j]);
        const T* b = pool + idx[j] * stride + c0;
        for (int64_t c = 0; c < EXPAND_COLUMNS; ++c) acc[c] += hj * to_f32(b[c]);
    }
}
#endif

// y[c] += sum over j < rank of h[j] * (pool row idx[j])[c], c < out: per 64 columns the
// sum in float32, then added to y's element and rounded once; the last out % 64 columns
// one at a time.
template <typename T>
void expand_row(T* y, const T* h, const T* pool, int64_t out, int64_t stride,
                const int64_t* idx, int64_t rank) {
    float acc[EXPAND_COLUMNS];
    int64_t c0 = 0;
    for (; c0 + EXPAND_COLUMNS <= out; c0 += EXPAND_COLUMNS) {
        sum_columns(acc, h, pool, stride, c0, idx, rank);
        for (int64_t c = 0; c < EXPAND_COLUMNS; ++c)
            y[c0 + c] = from_f32<T>(to_f32(y[c0 + c]) + acc[c]);
    }
    for (; c0 < out; ++c0) {
        float sum = 0.0f;
        for (int64_t j = 0; j < rank; ++j) sum += to_f32(h[j]) * to_f32(pool[idx[j] * stride + c0]);
        y[c0] = from_f32<T>(to_f32(y[c0]) + sum);
    }
}

template <int DT>
void expand_all(void* y_data, int64_t y_stride, int64_t out_offset, const void* h_data,
                int64_t h_stride, const void* pool_data, int64_t out, int64_t pool_stride,
                const int64_t* b_idx, int64_t b_stride, const int64_t* piece_ranks, const int64_t* rank_start,
                const int64_t* row_adapter, Selection rows, int64_t n, int num_threads) {
    using T = elem_t<DT>;
    T* y = static_cast<T*>(y_data);
    const T* h = static_cast<const T*>(h_data);
    const T* pool = static_cast<const T*>(pool_data);
    const bool parallel = num_threads > 1 && n * b_stride * out >= PARALLEL_MIN_WORK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) {
        const int64_t a = row_adapter[i];
        if (a < 0 || piece_ranks[a] == 0) continue;
        const int64_t t = rows[i];
        expand_row<T>(y + t * y_stride + out_offset, h + t * h_stride + rank_start[a], pool,
                      out, pool_stride, b_idx + a * b_stride, piece_ranks[a]);
    }
}

}  // namespace

extern "C" {

int cadence_lora_shrink(const void* x, int64_t x_stride, const void* rows_in, int64_t in,
                        int64_t rows_stride, const int64_t* a_idx, int64_t rmax, const int64_t* ranks,
                        const int64_t* row_adapter, const int64_t* rows, int64_t first_row,
                        int64_t n, void* h, int dtype, int num_threads) {
    const Selection selection{rows, first_row};
#define CALL(DT)                                                                            \
    shrink_all<DT>(x, x_stride, rows_in, in, rows_stride, a_idx, rmax, ranks, row_adapter, selection, n, \
                   h, num_threads)
    switch (dtype) {
        case F32: CALL(F32); return OK;
        case BF16: CALL(BF16); return OK;
        case F16: CALL(F16); return OK;
        default: return BAD_DTYPE;
    }
#undef CALL
}

int cadence_lora_expand(void* y, int64_t y_stride, int64_t out_offset, const void* h,
                        int64_t h_stride, const void* rows_out, int64_t out,
                        int64_t rows_stride, const int64_t* b_idx, int64_t b_stride, const int64_t* piece_ranks,
                        const int64_t* rank_start, const int64_t* row_adapter,
                        const int64_t* rows, int64_t first_row, int64_t n, int dtype,
                        int num_threads) {
    const Selection selection{rows, first_row};
#define CALL(DT)                                                                              \
    expand_all<DT>(y, y_stride, out_offset, h, h_stride, rows_out, out, rows_stride, b_idx, \
                   b_stride, piece_ranks, rank_start, row_adapter, selection, n, num_threads)
    switch (dtype) {
        case F32: CALL(F32); return OK;
        case BF16: CALL(BF16); return OK;
        case F16: CALL(F16); return OK;
        default: return BAD_DTYPE;
    }
#undef CALL
}

}  // extern "C"
