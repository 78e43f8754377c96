// The flat Llama step's elementwise layers, rounding where torch's layer rounds, so each
// matches the layer it replaces to the last bit except where a transcendental differs by
// an ulp: cadence_rms_norm (RMSNorm, with the residual add when given) and
// cadence_silu_mul (SwiGLU over the fused gate/up projection).

#include "cache_rows.h"
#include "cpu_elements.h"
#include "cpu_kernels.h"
#include "fast_exp.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace cadence_kernels;  // DType, Status

#ifdef CADENCE_AVX512_BF16
// rms_norm_all's arithmetic for a bfloat16 row of hidden % 16 == 0 elements.
inline void rms_norm_row_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* w,
                              uint16_t* out, uint16_t* residual_out, int64_t hidden, float eps,
                              float* row) {
    __m512 sq = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
        __m512 s = bf16x16_load(x + i);
        if (residual != nullptr) {
            s = bf16x16_round(_mm512_add_ps(s, bf16x16_load(residual + i)));
            bf16x16_store(residual_out + i, s);
        }
        _mm512_storeu_ps(row + i, s);
        sq = _mm512_fmadd_ps(s, s, sq);
    }
    const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(hidden) + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < hidden; i += 16) {
        const __m512 y = bf16x16_round(_mm512_mul_ps(_mm512_loadu_ps(row + i), vinv));
        bf16x16_store(out + i, bf16x16_round(_mm512_mul_ps(bf16x16_load(w + i), y)));
    }
}

// silu_mul_all's arithmetic for one bfloat16 row, inter % 16 == 0.
inline void silu_mul_row_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* out,
                              int64_t inter) {
    for (int64_t i = 0; i < inter; i += 16)
        bf16x16_store(out + i, silu_mul16(bf16x16_load(gate + i), bf16x16_load(up + i)));
}
#endif

// RMSNorm (Llama's): with a residual, s = x + residual (rounded) is also written out;
// y = weight * round(s * rsqrt(mean(s^2) + eps)).
template <int DT>
void rms_norm_all(const void* x, const void* residual, const void* weight, void* out,
                  void* residual_out, int64_t rows, int64_t hidden, float eps, int num_threads) {
#ifdef CADENCE_AVX512_BF16
    if (DT == BF16 && hidden % 16 == 0) {
        const auto* xs = static_cast<const uint16_t*>(x);
        const auto* rs = static_cast<const uint16_t*>(residual);
        auto* os = static_cast<uint16_t*>(out);
        auto* ros = static_cast<uint16_t*>(residual_out);
#pragma omp parallel num_threads(num_threads)
        {
            std::vector<float> row(hidden);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; ++r)
                rms_norm_row_bf16(xs + r * hidden, rs == nullptr ? nullptr : rs + r * hidden,
                                  static_cast<const uint16_t*>(weight), os + r * hidden,
                                  ros == nullptr ? nullptr : ros + r * hidden, hidden, eps,
                                  row.data());
        }
        return;
    }
#endif
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> row(hidden), w(hidden);
        load_row<DT>(weight, 0, w.data(), static_cast<int>(hidden));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            load_row<DT>(x, r * hidden, row.data(), static_cast<int>(hidden));
            if (residual != nullptr) {
#pragma omp simd
                for (int64_t i = 0; i < hidden; ++i)
                    row[i] = round_to<DT>(row[i] + load1<DT>(residual, r * hidden + i));
                store_row<DT>(residual_out, r * hidden, row.data(), 1.0f, static_cast<int>(hidden));
            }
            float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
            for (int64_t i = 0; i < hidden; ++i) sq += row[i] * row[i];
            const float inv = 1.0f / std::sqrt(sq / static_cast<float>(hidden) + eps);
#pragma omp simd
            for (int64_t i = 0; i < hidden; ++i)
                row[i] = round_to<DT>(w[i] * round_to<DT>(row[i] * inv));
            store_row<DT>(out, r * hidden, row.data(), 1.0f, static_cast<int>(hidden));
        }
    }
}

#ifdef CADENCE_AVX2
// silu_mul_all's float32 row, inter % 8 == 0, 8 lanes at a time (fast_exp in that loop
// stays scalar: the compiler will not vectorize its branches). The bits of that loop:
// 1 + exp(-g) = 1 + p * scale is the same fused or not, scale being a power of two (p *
// scale exact), and the FMA saves an instruction.
inline void silu_mul_row_f32(const float* gate, const float* up, float* out, int64_t inter) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < inter; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        __m256 scale, normal;
        const __m256 p = exp8_parts(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)), scale, normal);
        const __m256 den = _mm256_blendv_ps(one, _mm256_fmadd_ps(p, scale, one), normal);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, den), _mm256_loadu_ps(up + i)));
    }
}
#endif

// Runs a vector row kernel `row(gate, up, out, inter)` over every row of [gate | up].
template <typename T, typename Row>
void silu_mul_rows(const void* x, void* out, int64_t rows, int64_t inter, int num_threads,
                   Row row) {
    const auto* xs = static_cast<const T*>(x);
    auto* os = static_cast<T*>(out);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
        row(xs + r * 2 * inter, xs + r * 2 * inter + inter, os + r * inter, inter);
}

// SwiGLU over a fused projection x = [gate | up]: out = round(round(silu(gate)) * up).
template <int DT>
void silu_mul_all(const void* x, void* out, int64_t rows, int64_t inter, int num_threads) {
#ifdef CADENCE_AVX512_BF16
    if (DT == BF16 && inter % 16 == 0)
        return silu_mul_rows<uint16_t>(x, out, rows, inter, num_threads, silu_mul_row_bf16);
#endif
#ifdef CADENCE_AVX2
    if (DT == F32 && inter % 8 == 0)
        return silu_mul_rows<float>(x, out, rows, inter, num_threads, silu_mul_row_f32);
#endif
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> gate(inter), up(inter);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            load_row<DT>(x, r * 2 * inter, gate.data(), static_cast<int>(inter));
            load_row<DT>(x, r * 2 * inter + inter, up.data(), static_cast<int>(inter));
#pragma omp simd
            for (int64_t i = 0; i < inter; ++i) {
                const float g = gate[i];
                gate[i] = g / (1.0f + fast_exp(-g));
            }
#pragma omp simd
            for (int64_t i = 0; i < inter; ++i) gate[i] = round_to<DT>(round_to<DT>(gate[i]) * up[i]);
            store_row<DT>(out, r * inter, gate.data(), 1.0f, static_cast<int>(inter));
        }
    }
}

}  // namespace

extern "C" {

int cadence_rms_norm(const void* x, const void* residual, const void* weight, void* out,
                     void* residual_out, int64_t rows, int64_t hidden, float eps, int dtype,
                     int num_threads) {
#define CALL(DT) rms_norm_all<DT>(x, residual, weight, out, residual_out, rows, hidden, eps, num_threads)
    CADENCE_BY_DTYPE(dtype, CALL)
#undef CALL
}

int cadence_silu_mul(const void* x, void* out, int64_t rows, int64_t inter, int dtype,
                     int num_threads) {
#define CALL(DT) silu_mul_all<DT>(x, out, rows, inter, num_threads)
    CADENCE_BY_DTYPE(dtype, CALL)
#undef CALL
}

}  // extern "C"
