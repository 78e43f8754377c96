// CPU kernels of the shard's `cpu` attention backend and its flat Llama step. Built with
// g++ -O3 -fopenmp once per instruction set (cadence/kernels/cpu/builds.py, isa.py); the
// vector paths below are chosen at compile time by what that build's -march enables:
// CADENCE_AVX512_BF16, CADENCE_AVX2, else portable. Python calls them only through the
// torch operators of the shim cpu_ops.cpp (torch.ops.cadence.*), which checks every
// shape, dtype, device and layout (cpu_ops_checks.h) and calls the selected library's
// entry points (declared in cpu_kernels.h) through function pointers: each entry point
// below takes raw pointers and trusts them.
//
// Everything here is memory-bound work that torch on CPU does in several passes. The
// entry points (extern "C", each returning a Status):
//   - cadence_paged_decode_attention: one query per sequence reads its keys and values
//     straight from the paged cache through its block table (no gather into a padded
//     copy), with the query heads of one KV head together, online softmax over blocks;
//   - cadence_greedy_logprobs: greedy sampling with log-probabilities, the argmax, max
//     and log-sum-exp of each row in two passes over the logits instead of a full
//     log_softmax;
//   - cadence_rms_norm: RMSNorm, with the residual add when given;
//   - cadence_silu_mul: SwiGLU over the fused gate/up projection;
//   - cadence_rotary: the rotary embedding in place;
//   - cadence_rotary_write_kv: the rotary with the KV-cache write;
//   - cadence_decode_layer_attention: the two before, for a decode-only step, in one call;
// the elementwise ones each rounding where torch's layer rounds.
// OpenMP is the same runtime torch uses (its bundled libgomp.so.1 is loaded first).

#include "cpu_kernels.h"
#include "cpu_elements.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace cadence_kernels;  // DType, Status

template <int DT>
constexpr int64_t sizeof_dtype() {
    return DT == F32 ? 4 : (DT == BF16 || DT == F16) ? 2 : 1;
}

// The quantized KV cache's element types (cadence/kv_format.py): int8 with a scale per
// (slot, KV head), fp8 with one per layer.
template <int KT>
constexpr bool quantized() {
    return KT == I8 || KT == F8E4M3 || KT == F8E5M2;
}

// An fp8 element as IEEE half bits: e5m2 is half's top byte; e4m3's exponent and mantissa
// sit 7 bits up, where half reads them 2^8 too small (bias 15 against 7), subnormals
// included -- FP8_UNIT<F8E4M3> is that factor, applied with the scale.
inline uint16_t e4m3_half_bits(uint8_t b) {
    return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
}
inline uint16_t e5m2_half_bits(uint8_t b) { return static_cast<uint16_t>(b << 8); }

template <int KT>
constexpr float FP8_UNIT = KT == F8E4M3 ? 256.0f : 1.0f;

template <int KT>
inline float fp8_to_f32(uint8_t b) {
    const uint16_t bits = KT == F8E4M3 ? e4m3_half_bits(b) : e5m2_half_bits(b);
    half_t h;
    std::memcpy(&h, &bits, sizeof h);
    return static_cast<float>(h) * FP8_UNIT<KT>;
}

// float32 -> fp8 with E exponent bits (bias B) and M mantissa bits, rounded to nearest
// even, |x| at most the format's largest value (the caller clamps): what torch's
// conversion to float8_e4m3fn / float8_e5m2 gives.
template <int E, int M, int B>
inline uint8_t f32_to_fp8(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const uint32_t sign = (bits >> 24) & 0x80u, mag = bits & 0x7fffffffu;
    uint32_t code;
    if (mag < static_cast<uint32_t>(127 - B + 1) << 23) {  // below the smallest normal:
        // a multiple of the subnormal step 2^(1 - B - M), which as a code is that count
        float a;
        std::memcpy(&a, &mag, sizeof a);
        code = static_cast<uint32_t>(std::nearbyint(std::ldexp(a, B - 1 + M)));
    } else {
        const int drop = 23 - M;
        const uint32_t rounded = mag + ((1u << (drop - 1)) - 1) + ((mag >> drop) & 1u);
        code = ((rounded >> 23) - 127 + B) << M | ((rounded >> drop) & ((1u << M) - 1));
    }
    return static_cast<uint8_t>(sign | code);
}

template <int KT>
inline uint8_t f32_to_fp8_of(float x) {
    return KT == F8E4M3 ? f32_to_fp8<4, 3, 7>(x) : f32_to_fp8<5, 2, 15>(x);
}

// Row loads/stores between the cache's element type and float32 scratch (a quantized
// cache's elements as stored, before their scale).
template <int DT>
inline void load_row(const void* src, int64_t offset, float* dst, int n) {
    if constexpr (DT == I8) {
        const int8_t* s = static_cast<const int8_t*>(src) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
    } else if constexpr (DT == F8E4M3 || DT == F8E5M2) {
        const uint8_t* s = static_cast<const uint8_t*>(src) + offset;
        for (int i = 0; i < n; ++i) dst[i] = fp8_to_f32<DT>(s[i]);
    } else if constexpr (DT == F32) {
        const float* s = static_cast<const float*>(src) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) dst[i] = s[i];
    } else if constexpr (DT == BF16) {
        const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
    } else {
        const half_t* s = static_cast<const half_t*>(src) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
    }
}

template <int DT>
inline void store_row(void* dst, int64_t offset, const float* src, float mul, int n) {
    if constexpr (DT == F32) {
        float* d = static_cast<float*>(dst) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) d[i] = src[i] * mul;
    } else if constexpr (DT == BF16) {
        uint16_t* d = static_cast<uint16_t*>(dst) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i] * mul);
    } else {
        half_t* d = static_cast<half_t*>(dst) + offset;
#pragma omp simd
        for (int i = 0; i < n; ++i) d[i] = static_cast<half_t>(src[i] * mul);
    }
}

// The scale of the cache row `row` (slot * kv_heads + head): int8's own, fp8's layer one,
// 1 for a float cache.
template <int KT>
inline float row_scale(const float* scales, int64_t row) {
    if constexpr (KT == I8) return scales[row];
    if constexpr (KT == F8E4M3 || KT == F8E5M2) return scales[0];
    return 1.0f;
}

// One KV head's n new elements x (float32, already rounded to the activations' dtype)
// into cache row `row` (slot * kv_heads + head) of a KT cache. int8: amax / 127 into
// scales[row], x * (127 / amax) rounded half to even; fp8: x * (1 / scales[0]), clamped
// to the format's range, rounded -- cadence/kv_format.py's arithmetic, for the same bits.
template <int KT>
inline void store_kv_row(void* cache, float* scales, int64_t row, const float* x, int n) {
    if constexpr (KT == I8) {
        float amax = 0.0f;
        for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t* d = static_cast<int8_t*>(cache) + row * n;
        for (int i = 0; i < n; ++i)
            d[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] * inv))));
        scales[row] = amax / 127.0f;
    } else if constexpr (KT == F8E4M3 || KT == F8E5M2) {
        const float top = KT == F8E4M3 ? 448.0f : 57344.0f;
        const float inv = 1.0f / scales[0];
        uint8_t* d = static_cast<uint8_t*>(cache) + row * n;
        for (int i = 0; i < n; ++i)
            d[i] = f32_to_fp8_of<KT>(std::min(top, std::max(-top, x[i] * inv)));
    } else {
        store_row<KT>(cache, row * n, x, 1.0f, n);
    }
}

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// 2^f for |f| <= 1/2: Taylor coefficients of degree 7 down to 0, shared by fast_exp and exp16.
constexpr int EXP2_POLY_TERMS = 8;
constexpr float EXP2_POLY[EXP2_POLY_TERMS] = {
    1.5252733804059838e-05f, 0.00015403530393381606f, 0.0013333558146428441f,
    0.009618129107628477f,   0.055504108664821576f,   0.2402265069591007f,
    0.6931471805599453f,     1.0f};

// exp(x) in a form the compiler vectorizes (libm's expf is a scalar call): x = n ln2 +
// f ln2 with n an integer and |f| <= 1/2, 2^f by its Taylor series to degree 7 (relative
// error below 1e-8), 2^n by writing the exponent bits. Inputs below -87 give 0, so
// exp(-inf) is 0 as the online softmax needs.
inline float fast_exp(float x) {
    float y = x * 1.4426950408889634f;
    const bool underflow = !(y > -126.0f);  // also true for NaN-free -inf
    y = std::min(y, 126.0f);
    y = std::max(y, -126.0f);
    const float n = (y + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
    const float f = y - n;
    float p = EXP2_POLY[0];
    for (int i = 1; i < EXP2_POLY_TERMS; ++i) p = p * f + EXP2_POLY[i];
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return underflow ? 0.0f : p * scale;
}

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

// A kernel of one whole sequence (decode_seq_avx2, decode_seq_dpbf16): q, out, the caches,
// their scales, the sequence's block table, its context length, its index, num_heads,
// num_kv_heads, block_size, scale, window, the calling thread's scratch.
using DecodeSeqFn = void (*)(const void*, void*, const void*, const void*, const float*,
                             const float*, const int64_t*, int64_t, int64_t, int, int, int,
                             float, int64_t, float*);

#ifdef CADENCE_AVX2
// ---- decode attention in 8 float32 lanes (AVX2 + FMA + F16C) ----------------------------
// Any query and cache dtype (the path of the float32 servers below AVX512-BF16), head_dim
// D a multiple of 16, block_size a multiple of 8: one sequence, all of its KV heads, so
// each cache block is read front to back once. Keys and values are read in place and
// converted in registers; each query head scores 8 rows at a time with one accumulator
// per row and a single transposed reduction, the block's softmax step runs in registers,
// and each head accumulates its D dimensions in registers.

// Asks for cache lines ahead of use: blocks sit anywhere in the pool, so the hardware
// prefetcher only finds each one after its start (and stops at every 4 KiB page).
inline void prefetch_block(const void* rows, int64_t bytes) {
    const char* p = static_cast<const char*>(rows);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
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
// (`pair_order`): dot products and sums do not care.
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

// Where element d of a head sits in load16's order.
template <int DT>
inline int pair_order(int d) {
    return DT == BF16 ? d / 16 * 16 + d % 2 * 8 + d % 16 / 2 : d;
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

// fast_exp on 8 lanes, in pieces: exp(x) = p * scale (scale = 2^n written into the
// exponent) in the lanes of `normal`, 0 in the others. The same operations as fast_exp,
// whose polynomial the compiler fuses into FMAs too: the same bits.
inline __m256 exp8_parts(__m256 x, __m256& scale, __m256& normal) {
    __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
    normal = _mm256_cmp_ps(y, _mm256_set1_ps(-126.0f), _CMP_GT_OQ);
    y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(126.0f));
    const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(y, n);
    __m256 p = _mm256_set1_ps(EXP2_POLY[0]);
    for (int i = 1; i < EXP2_POLY_TERMS; ++i)
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[i]));
    scale = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    return p;
}

inline __m256 exp8(__m256 x) {
    __m256 scale, normal;
    const __m256 p = exp8_parts(x, scale, normal);
    return _mm256_and_ps(normal, _mm256_mul_ps(p, scale));
}

// One query head (qf, in pair_order) against 8 rows of KT elements `stride` apart.
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
// `stride` apart, acc in pair_order), in 2N registers. Rows past hi are never read.
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

// A quantized cache is read as stored and its scales applied outside the inner loops:
// fp8's layer scales fold into the query (keys) and the final 1 / sum (values); int8's
// per-row key scales multiply each row's score, its value scales each row's probability.
template <int QT, int KT, int D>
void decode_seq_avx2(const void* q, void* out, const void* k_cache, const void* v_cache,
                     const float* k_scale, const float* v_scale, const int64_t* table,
                     int64_t context_len, int64_t seq, int num_heads, int num_kv_heads,
                     int block_size, float scale, int64_t window, float* scratch) {
    constexpr int N = value_chunks<D>();
    const int G = num_heads / num_kv_heads;
    float* qf = scratch;                        // [H, D] queries times scale, pair_order
    float* acc = qf + num_heads * D;            // [H, D] pair_order
    float* s = acc + num_heads * D;             // [H, block_size] scores, then probabilities
    float* m = s + num_heads * block_size;      // [H] running max
    float* l = m + num_heads;                   // [H] running sum
    float* correction = l + num_heads;          // [H] this block's rescaling
    float* row = correction + num_heads;        // [D]
    float* vs = row + D;                        // [block_size] an int8 block's value scales
    constexpr bool per_row = KT == I8, per_layer = KT == F8E4M3 || KT == F8E5M2;
    const float q_mul = per_layer ? scale * k_scale[0] * FP8_UNIT<KT> : scale;
    const float out_mul = per_layer ? v_scale[0] * FP8_UNIT<KT> : 1.0f;
    for (int h = 0; h < num_heads; ++h) {
        load_row<QT>(q, (seq * num_heads + h) * D, row, D);
        for (int d = 0; d < D; ++d) qf[h * D + pair_order<KT>(d)] = row[d] * q_mul;
    }
    std::fill(acc, acc + num_heads * D, 0.0f);
    std::fill(m, m + num_heads, NEG_INF);
    std::fill(l, l + num_heads, 0.0f);
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
    const int64_t row_stride = static_cast<int64_t>(num_kv_heads) * D;
    const int64_t block_bytes = block_size * row_stride * sizeof_dtype<KT>();
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
            for (int h = kh * G; h < (kh + 1) * G; ++h) {
                for (int t = lo / 8 * 8; t < hi; t += 8) {  // whole groups of 8 rows
                    next.next_slice();
                    __m256 sc =
                        scores8<KT, D>(qf + h * D, k_cache, at + t * row_stride, row_stride);
                    if constexpr (per_row) {  // rows past hi: the block's own, masked below
                        const __m256i rows = _mm256_mullo_epi32(
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                            _mm256_set1_epi32(num_kv_heads));
                        sc = _mm256_mul_ps(
                            sc, _mm256_i32gather_ps(k_scale + (base + t) * num_kv_heads + kh,
                                                    rows, 4));
                    }
                    _mm256_storeu_ps(s + h * block_size + t, sc);
                }
            }
            softmax_heads8(s + kh * G * block_size, block_size, G, lo, hi, m + kh * G, l + kh * G,
                           correction + kh * G);
            if constexpr (per_row) {  // l summed the plain probabilities; acc takes p * scale
                for (int t = lo; t < hi; ++t) vs[t] = v_scale[(base + t) * num_kv_heads + kh];
                for (int h = kh * G; h < (kh + 1) * G; ++h)
                    for (int t = lo; t < hi; ++t) s[h * block_size + t] *= vs[t];
            }
            for (int h = kh * G; h < (kh + 1) * G; ++h) {
                next.next_slice();
                for (int c = 0; c < D; c += 16 * N)
                    accumulate_values16<KT, N>(v_cache, at + c, row_stride, s + h * block_size,
                                               lo, hi, correction[h], acc + h * D + c);
            }
        }
        next.rest();  // what a partial block's fewer passes left over
    }
    for (int h = 0; h < num_heads; ++h) {
        const float inv = l[h] > 0.0f ? out_mul / l[h] : 0.0f;  // no visible key: zeros
        for (int d = 0; d < D; ++d) row[d] = acc[h * D + pair_order<KT>(d)];
        store_row<QT>(out, (seq * num_heads + h) * D, row, inv, D);
    }
}

template <int QT, int KT>
DecodeSeqFn pick_avx2(int head_dim, int block_size) {
    if (block_size % 8 != 0) return nullptr;
    switch (head_dim) {
        case 32: return decode_seq_avx2<QT, KT, 32>;
        case 64: return decode_seq_avx2<QT, KT, 64>;
        case 80: return decode_seq_avx2<QT, KT, 80>;
        case 96: return decode_seq_avx2<QT, KT, 96>;
        case 128: return decode_seq_avx2<QT, KT, 128>;
        case 256: return decode_seq_avx2<QT, KT, 256>;
        default: return nullptr;
    }
}
#endif

#ifdef CADENCE_AVX512_BF16
// Decode attention with AVX512-BF16's vdpbf16ps (bfloat16 pairs into float32, exact
// products), head_dim D a multiple of 32 (up to 256): one sequence, all of its KV heads,
// so each cache block is read front to back once. It reads a bfloat16 cache as stored
// and an int8 one converted to bfloat16 in registers (exact: every int8 value is a
// bfloat16 one): a block's keys once per KV head into scratch, which all of its query
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

// fast_exp on 16 lanes: the same polynomial, 2^n applied by vscalefps.
inline __m512 exp16(__m512 x) {
    __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __mmask16 normal = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
    y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(126.0f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
    for (int i = 1; i < EXP2_POLY_TERMS; ++i)
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[i]));
    return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
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
    switch (head_dim) {
        case 32: return decode_seq_dpbf16<QT, KT, 32>;
        case 64: return decode_seq_dpbf16<QT, KT, 64>;
        case 96: return decode_seq_dpbf16<QT, KT, 96>;
        case 128: return decode_seq_dpbf16<QT, KT, 128>;
        case 256: return decode_seq_dpbf16<QT, KT, 256>;
        default: return nullptr;
    }
}
#endif

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

template <int QT, int KT>
void decode_all(const void* q, void* out, const void* k_cache, const void* v_cache,
                const float* k_scale, const float* v_scale, const int64_t* block_tables, int64_t table_stride, const int64_t* context_lens,
                int64_t num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                float scale, int64_t window, int num_threads) {
    DecodeSeqFn fn = nullptr;
    int64_t scratch_floats = 0;
#ifdef CADENCE_AVX512_BF16
    if constexpr (dpbf16_serves<QT, KT>()) {
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


#ifdef CADENCE_AVX512_BF16
inline __m512 negate16(__m512 x) { return _mm512_xor_ps(x, _mm512_set1_ps(-0.0f)); }

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
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < inter; i += 16) {
        const __m512 g = bf16x16_load(gate + i);
        const __m512 e = exp16(negate16(g));
        const __m512 silu = bf16x16_round(_mm512_div_ps(g, _mm512_add_ps(one, e)));
        bf16x16_store(out + i, bf16x16_round(_mm512_mul_ps(silu, bf16x16_load(up + i))));
    }
}

// rotate_head's arithmetic for a bfloat16 head, head_dim % 32 == 0; dst may be src.
inline void rotate_head_bf16(const uint16_t* src, const uint16_t* c, const uint16_t* s,
                             uint16_t* dst, int head_dim) {
    const int half = head_dim / 2;
    for (int i = 0; i < half; i += 16) {
        const __m512 x1 = bf16x16_load(src + i), x2 = bf16x16_load(src + half + i);
        const __m512 c1 = bf16x16_load(c + i), c2 = bf16x16_load(c + half + i);
        const __m512 s1 = bf16x16_load(s + i), s2 = bf16x16_load(s + half + i);
        const __m512 lo = bf16x16_round(
            _mm512_add_ps(bf16x16_round(_mm512_mul_ps(x1, c1)),
                          bf16x16_round(_mm512_mul_ps(negate16(x2), s1))));
        const __m512 hi = bf16x16_round(_mm512_add_ps(bf16x16_round(_mm512_mul_ps(x2, c2)),
                                                      bf16x16_round(_mm512_mul_ps(x1, s2))));
        bf16x16_store(dst + i, lo);
        bf16x16_store(dst + half + i, hi);
    }
}
#endif

// ---- elementwise layers, rounding where torch rounds ------------------------------------
// torch computes a bfloat16/float16 op in float32 and rounds its result to the tensor's
// dtype; each kernel below rounds at the same points, so it matches the torch layer it
// replaces to the last bit except where a transcendental differs by an ulp.

template <int DT>
inline float round_to(float x) {
    if constexpr (DT == F32) {
        return x;
    } else if constexpr (DT == BF16) {
        return bf16_to_f32(f32_to_bf16(x));
    } else {
        return static_cast<float>(static_cast<half_t>(x));
    }
}

template <int DT>
inline float load1(const void* p, int64_t i) {
    float f;
    load_row<DT>(p, i, &f, 1);
    return f;
}

template <int DT>
inline void store1(void* p, int64_t i, float f) {
    store_row<DT>(p, i, &f, 1.0f, 1);
}

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
// there the compiler fuses 1 + exp(-g) = 1 + p * scale into one FMA, so here too.
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

// Rotary embedding (the half-split "neox" layout) of one head read at x[at, at + head_dim):
// c/s are its token's cos/sin already rounded to the dtype, v scratch; o gets
// x' = round(round(x * cos) + round(rotate(x) * sin)) as float32.
template <int DT>
inline void rotate_head(const void* x, int64_t at, const float* c, const float* s, float* v,
                        float* o, int head_dim) {
    const int half = head_dim / 2;
    load_row<DT>(x, at, v, head_dim);
#pragma omp simd
    for (int i = 0; i < half; ++i)  // first half: x1 cos - x2 sin
        o[i] = round_to<DT>(round_to<DT>(v[i] * c[i]) + round_to<DT>(-v[i + half] * s[i]));
#pragma omp simd
    for (int i = half; i < head_dim; ++i)  // second half: x2 cos + x1 sin
        o[i] = round_to<DT>(round_to<DT>(v[i] * c[i]) + round_to<DT>(v[i - half] * s[i]));
}

// Whether the bfloat16 vector path takes a head of this size.
template <int DT>
constexpr bool rotary_vector(int head_dim) {
#ifdef CADENCE_AVX512_BF16
    return DT == BF16 && head_dim % 32 == 0;
#else
    (void)head_dim;
    return false;
#endif
}

// One token's heads [first, first + heads) of x (row `at`), rotated into dst (DST_T
// elements at dst_at, heads packed) -- which may be the same place.
template <int DT, int DST_T>
inline void rotate_heads(const void* x, int64_t at, int heads, int head_dim, const void* cos,
                         const void* sin, int64_t t, void* dst, int64_t dst_at, float* c,
                         float* s, float* v, float* o) {
#ifdef CADENCE_AVX512_BF16
    if constexpr (DT == BF16 && DST_T == BF16) {
        if (rotary_vector<DT>(head_dim)) {
            const auto* cs = static_cast<const uint16_t*>(cos) + t * head_dim;
            const auto* ss = static_cast<const uint16_t*>(sin) + t * head_dim;
            for (int h = 0; h < heads; ++h)
                rotate_head_bf16(static_cast<const uint16_t*>(x) + at + h * head_dim, cs, ss,
                                 static_cast<uint16_t*>(dst) + dst_at + h * head_dim, head_dim);
            return;
        }
    }
#endif
    load_row<DT>(cos, t * head_dim, c, head_dim);
    load_row<DT>(sin, t * head_dim, s, head_dim);
    for (int h = 0; h < heads; ++h) {
        rotate_head<DT>(x, at + static_cast<int64_t>(h) * head_dim, c, s, v, o, head_dim);
        store_row<DST_T>(dst, dst_at + static_cast<int64_t>(h) * head_dim, o, 1.0f, head_dim);
    }
}

// In place on x [T, heads, head_dim] with row stride x_stride (a view into the fused QKV
// output): cos/sin [T, head_dim] already rounded to the dtype.
template <int DT>
void rotary_all(void* x, int64_t tokens, int heads, int head_dim, int64_t x_stride,
                const void* cos, const void* sin, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> c(head_dim), s(head_dim), v(head_dim), o(head_dim);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; ++t)
            rotate_heads<DT, DT>(x, t * x_stride, heads, head_dim, cos, sin, t, x, t * x_stride,
                                 c.data(), s.data(), v.data(), o.data());
    }
}

// The attention layer's first half for T new tokens of a fused QKV output [T, x_stride]
// (heads q | kv_heads k | kv_heads v): the queries rotated into q_out [T, heads,
// head_dim], the keys rotated and the values copied into their cache slots (KT elements,
// cache rows [slot, kv_heads, head_dim]). Every token writes its own slot only.
template <int DT, int KT>
void rotary_write_kv_all(const void* qkv, int64_t tokens, int64_t x_stride, int heads,
                         int kv_heads, int head_dim, const void* cos, const void* sin,
                         void* q_out, void* k_cache, void* v_cache, float* k_scale,
                         float* v_scale, const int64_t* slots, int num_threads) {
    const int64_t kv_row = static_cast<int64_t>(kv_heads) * head_dim;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> c(head_dim), s(head_dim), v(head_dim), o(head_dim);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; ++t) {
            const int64_t row = t * x_stride, k_at = row + heads * head_dim;
            rotate_heads<DT, DT>(qkv, row, heads, head_dim, cos, sin, t, q_out,
                                 t * heads * head_dim, c.data(), s.data(), v.data(), o.data());
            if constexpr (quantized<KT>()) {  // each head rotated, then quantized
                load_row<DT>(cos, t * head_dim, c.data(), head_dim);
                load_row<DT>(sin, t * head_dim, s.data(), head_dim);
                for (int h = 0; h < kv_heads; ++h) {
                    rotate_head<DT>(qkv, k_at + h * head_dim, c.data(), s.data(), v.data(),
                                    o.data(), head_dim);
                    store_kv_row<KT>(k_cache, k_scale, slots[t] * kv_heads + h, o.data(), head_dim);
                    load_row<DT>(qkv, k_at + kv_row + h * head_dim, v.data(), head_dim);
                    store_kv_row<KT>(v_cache, v_scale, slots[t] * kv_heads + h, v.data(), head_dim);
                }
                continue;
            } else {
                rotate_heads<DT, KT>(qkv, k_at, kv_heads, head_dim, cos, sin, t, k_cache,
                                     slots[t] * kv_row, c.data(), s.data(), v.data(), o.data());
            }
            if constexpr (DT == KT) {
                std::memcpy(static_cast<char*>(v_cache) + slots[t] * kv_row * sizeof_dtype<KT>(),
                            static_cast<const char*>(qkv) + (k_at + kv_row) * sizeof_dtype<DT>(),
                            kv_row * sizeof_dtype<KT>());
            } else {
                for (int h = 0; h < kv_heads; ++h) {
                    load_row<DT>(qkv, k_at + kv_row + h * head_dim, v.data(), head_dim);
                    store_row<KT>(v_cache, slots[t] * kv_row + h * head_dim, v.data(), 1.0f, head_dim);
                }
            }
        }
    }
}

// ---- greedy sampling with log-probabilities ----------------------------------------------

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

// The same for a row without NaN or +inf, written for the compiler to vectorize (the
// path below AVX512-BF16): false (nothing written) for a row the scan above must take.
template <int DT>
bool greedy_row_lanes(const void* x, int64_t at, int64_t vocab, int64_t* id, float* logprob) {
    float best = NEG_INF;
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t i = 0; i < vocab; ++i) {
        const float v = load1<DT>(x, at + i);
        best = std::max(best, v);
        nan |= v != v;
    }
    if (nan || !std::isfinite(best)) return false;
    int64_t arg = 0;
    while (load1<DT>(x, at + arg) != best) ++arg;
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

extern "C" {

#define CADENCE_BY_DTYPE(dtype, call)     \
    switch (dtype) {                      \
        case F32: call(F32); return OK;   \
        case BF16: call(BF16); return OK; \
        case F16: call(F16); return OK;   \
        default: return BAD_DTYPE;        \
    }

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

int cadence_rotary(void* x, int64_t tokens, int heads, int head_dim, int64_t x_stride,
                   const void* cos, const void* sin, int dtype, int num_threads) {
#define CALL(DT) rotary_all<DT>(x, tokens, heads, head_dim, x_stride, cos, sin, num_threads)
    CADENCE_BY_DTYPE(dtype, CALL)
#undef CALL
}

// qkv: [tokens, x_stride] of dtype (q heads | k heads | v heads per row); cos/sin:
// [tokens, head_dim] of dtype; q_out: [tokens, heads, head_dim] of dtype; caches of
// kv_dtype [slots, kv_heads, head_dim]; slots: [tokens] int64. See rotary_write_kv_all.
int cadence_rotary_write_kv(const void* qkv, int64_t tokens, int64_t x_stride, int heads,
                            int kv_heads, int head_dim, const void* cos, const void* sin,
                            void* q_out, void* k_cache, void* v_cache, float* k_scale,
                            float* v_scale, const int64_t* slots, int dtype, int kv_dtype,
                            int num_threads) {
#define CADENCE_WRITE(DT, KT)                                                              \
    if (dtype == DT && kv_dtype == KT) {                                                   \
        rotary_write_kv_all<DT, KT>(qkv, tokens, x_stride, heads, kv_heads, head_dim, cos, \
                                    sin, q_out, k_cache, v_cache, k_scale, v_scale, slots, \
                                    num_threads);                                          \
        return OK;                                                                         \
    }
    CADENCE_WRITE(F32, F32)
    CADENCE_WRITE(BF16, BF16)
    CADENCE_WRITE(F16, F16)
    CADENCE_WRITE(F32, BF16)
    CADENCE_WRITE(F32, F16)
    CADENCE_WRITE(BF16, F32)
    CADENCE_WRITE(F16, F32)
    CADENCE_WRITE(F32, I8)
    CADENCE_WRITE(BF16, I8)
    CADENCE_WRITE(F16, I8)
    CADENCE_WRITE(F32, F8E4M3)
    CADENCE_WRITE(BF16, F8E4M3)
    CADENCE_WRITE(F16, F8E4M3)
    CADENCE_WRITE(F32, F8E5M2)
    CADENCE_WRITE(BF16, F8E5M2)
    CADENCE_WRITE(F16, F8E5M2)
#undef CADENCE_WRITE
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
