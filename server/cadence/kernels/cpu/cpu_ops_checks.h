// What each operator of cpu_ops.cpp requires of its arguments, checked in one place: the
// operator's CPU implementation and its Meta one (what FakeTensor tracing, torch.compile
// and torch.library.opcheck run) both call these, which return the sizes the kernel call
// needs. A failed check is a ValueError naming the operator, the argument, what it must
// be and what it is.
//
// The kernels read and write through raw pointers, so these checks are what keeps a wrong
// shape, dtype or layout from becoming an out-of-bounds access. Tensors the kernel only
// reads may have any strides (the operator packs them when they are not); tensors it
// writes must already have the layout it writes, since a packed copy would lose the
// write. The values inside the index tensors (block ids, slots, context lengths) are the
// scheduler's and are not scanned: that would be a pass over them on every call.
//
// Sizes are read as SymInts: concrete on CPU (the same integers, no cost worth naming),
// symbolic when the Meta implementation traces with dynamic shapes, where a comparison
// becomes a guard as it would in Python.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/Exception.h>

#include <array>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

namespace cadence_ops::checks {

using at::Tensor;
using c10::ScalarType;
using c10::SymInt;

// ---- messages ----------------------------------------------------------------------------

// The dtype as Python prints it ("torch.bfloat16"), so a message names what the caller wrote.
inline std::string dtype_name(ScalarType t) {
    switch (t) {
        case ScalarType::Float: return "torch.float32";
        case ScalarType::Double: return "torch.float64";
        case ScalarType::BFloat16: return "torch.bfloat16";
        case ScalarType::Half: return "torch.float16";
        case ScalarType::Long: return "torch.int64";
        case ScalarType::Int: return "torch.int32";
        case ScalarType::Short: return "torch.int16";
        case ScalarType::Char: return "torch.int8";
        case ScalarType::Byte: return "torch.uint8";
        case ScalarType::Bool: return "torch.bool";
        default: return std::string("torch.") + c10::toString(t);
    }
}

// "torch.bfloat16 [3, 4, 64] on cpu", with ", strides (...)" when it is not contiguous.
inline std::string describe(const Tensor& t) {
    std::ostringstream s;
    s << dtype_name(t.scalar_type()) << ' ' << t.sym_sizes() << " on " << t.device();
    if (!t.is_contiguous()) {
        const auto strides = t.sym_strides();
        s << ", strides (";
        for (size_t i = 0; i < strides.size(); ++i) s << (i ? ", " : "") << strides[i];
        s << (strides.size() == 1 ? ",)" : ")");
    }
    return s.str();
}

template <typename... Parts>
[[noreturn]] void fail(const char* op, const Parts&... parts) {
    C10_THROW_ERROR(ValueError, c10::str("cadence::", op, ": ", parts...));
}

// "cadence::{op}: {arg} must be {want}, got {t described}"; called only once a check
// failed, so `want` is formatted on the error path alone.
[[noreturn]] inline void bad(const char* op, const char* arg, const std::string& want,
                             const Tensor& t) {
    fail(op, arg, " must be ", want, ", got ", describe(t));
}

template <size_t N>
std::string shape_text(const std::array<SymInt, N>& shape) {
    std::ostringstream s;
    s << c10::ArrayRef<SymInt>(shape);
    return s.str();
}

// ---- shared parts ------------------------------------------------------------------------

inline bool is_kernel_dtype(ScalarType t) {
    return t == ScalarType::Float || t == ScalarType::BFloat16 || t == ScalarType::Half;
}

// The quantized KV cache's element types (cadence/kv_format.py): any activations read them.
inline bool is_quantized_cache(ScalarType t) {
    return t == ScalarType::Char || t == ScalarType::Float8_e4m3fn ||
           t == ScalarType::Float8_e5m2;
}

// Whether t is, or stands for, a CPU tensor: read from its dispatch keys, not its device,
// because FakeTensor runs the Meta implementation with every tensor reporting the meta
// device while its keys keep the backend of the device it stands for.
inline bool for_cpu(const Tensor& t) {
    return t.key_set().has_backend(c10::BackendComponent::CPUBit);
}

// Every tensor of a call reaching the Meta implementation is, or stands for, a CPU tensor,
// or none is. The dispatcher sends a call there when any of its tensors is on meta: a
// CPU operator's call with one meta tensor among CPU ones (real or fake) is an error
// naming it; a call on meta tensors alone computes the output shapes.
inline void on_cpu(const char* op,
                   std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
    bool any_cpu = false;
    for (const auto& [name, t] : tensors) any_cpu |= for_cpu(*t);
    if (!any_cpu) return;
    for (const auto& [name, t] : tensors) {
        if (!for_cpu(*t)) bad(op, name, "a CPU tensor", *t);
    }
}

// t is where the kernel writes `shape` elements of `dtype`: contiguous, nothing else.
template <size_t N>
void written(const char* op, const char* arg, const Tensor& t, const std::array<SymInt, N>& shape,
             ScalarType dtype) {
    if (!t.sym_sizes().equals(shape) || t.scalar_type() != dtype || !t.is_contiguous()) {
        bad(op, arg, c10::str("a contiguous ", dtype_name(dtype), ' ', shape_text(shape)), t);
    }
}

struct CacheSizes {
    SymInt block_size, kv_heads, head_dim;
};

// The paged caches [blocks, block_size, kv_heads, head_dim], contiguous (the kernels index
// them in place), of one dtype the kernels pair with `dtype` activations: the same, or one
// of the two float32.
inline CacheSizes cache(const char* op, ScalarType dtype, const Tensor& k_cache,
                        const Tensor& v_cache) {
    const auto shape = k_cache.sym_sizes();
    const ScalarType kv_dtype = k_cache.scalar_type();
    if (shape.size() != 4 || !k_cache.is_contiguous() || shape[2] == 0 || shape[3] == 0) {
        bad(op, "k_cache", "a contiguous [blocks, block_size, kv_heads, head_dim] tensor",
            k_cache);
    }
    if (!v_cache.sym_sizes().equals(shape) || v_cache.scalar_type() != kv_dtype ||
        !v_cache.is_contiguous()) {
        bad(op, "v_cache",
            c10::str("contiguous, shaped and typed as k_cache (", describe(k_cache), ")"),
            v_cache);
    }
    if (is_quantized_cache(kv_dtype)) return {shape[1], shape[2], shape[3]};
    if (!is_kernel_dtype(kv_dtype)) {
        bad(op, "k_cache", "float32, bfloat16, float16, int8, float8_e4m3fn or float8_e5m2",
            k_cache);
    }
    if (kv_dtype != dtype && dtype != ScalarType::Float && kv_dtype != ScalarType::Float) {
        fail(op, "no kernel for ", dtype_name(dtype), " activations over a ",
             dtype_name(kv_dtype),
             " cache (k_cache, v_cache): the cache is in their dtype, or one of the two is "
             "float32");
    }
    return {shape[1], shape[2], shape[3]};
}

// A quantized cache's scales, float32: int8's [blocks, block_size, kv_heads] contiguous
// (one per slot and KV head), fp8's one element (the layer's); a float cache takes none.
inline void cache_scales(const char* op, const Tensor& k_cache,
                         const std::optional<Tensor>& k_scale,
                         const std::optional<Tensor>& v_scale) {
    const ScalarType kv_dtype = k_cache.scalar_type();
    if (!is_quantized_cache(kv_dtype)) {
        if (k_scale || v_scale) {
            fail(op, "k_scale and v_scale are for an int8 or fp8 cache, not a ",
                 dtype_name(kv_dtype), " one");
        }
        return;
    }
    const auto shape = k_cache.sym_sizes();
    const bool per_slot = kv_dtype == ScalarType::Char;
    const std::string want =
        per_slot ? c10::str("a contiguous torch.float32 [", shape[0], ", ", shape[1], ", ",
                            shape[2], "] (the int8 cache's scale per slot and KV head)")
                 : std::string("a torch.float32 tensor of one element (the layer's scale)");
    for (const auto& [name, t] : {std::pair{"k_scale", &k_scale}, std::pair{"v_scale", &v_scale}}) {
        if (!*t) fail(op, name, " must be given with a ", dtype_name(kv_dtype), " cache: ", want);
        const Tensor& x = **t;
        const bool ok = x.scalar_type() == ScalarType::Float &&
                        (per_slot ? x.sym_sizes().equals({shape[0], shape[1], shape[2]}) &&
                                        x.is_contiguous()
                                  : x.sym_numel() == 1);
        if (!ok) bad(op, name, want, x);
    }
}

// cos and sin [tokens, (1,) head_dim] in the activations' dtype.
inline void cos_sin(const char* op, const Tensor& cos, const Tensor& sin, const SymInt& tokens,
                    const SymInt& head_dim, ScalarType dtype) {
    const auto shape = cos.sym_sizes();
    if (cos.scalar_type() != dtype || shape.size() < 2 || shape[0] != tokens ||
        shape.back() != head_dim || cos.sym_numel() != tokens * head_dim) {
        bad(op, "cos", c10::str(dtype_name(dtype), " [", tokens, ", (1,) ", head_dim, "]"), cos);
    }
    if (!sin.sym_sizes().equals(shape) || sin.scalar_type() != dtype) {
        bad(op, "sin", c10::str("shaped and typed as cos (", describe(cos), ")"), sin);
    }
}

// A block table row and a context length per sequence.
inline void decode_rows(const char* op, const SymInt& seqs, const Tensor& block_tables,
                        const Tensor& context_lens) {
    const auto shape = block_tables.sym_sizes();
    if (block_tables.scalar_type() != ScalarType::Long || shape.size() != 2 || shape[0] != seqs) {
        bad(op, "block_tables", c10::str("int64 [", seqs, ", blocks]"), block_tables);
    }
    const auto lens = context_lens.sym_sizes();
    if (context_lens.scalar_type() != ScalarType::Long || lens.size() != 1 || lens[0] != seqs) {
        bad(op, "context_lens", c10::str("int64 [", seqs, "]"), context_lens);
    }
}

// ---- per operator ------------------------------------------------------------------------

struct AttentionSizes {
    SymInt seqs, heads, kv_heads, head_dim, block_size;
};

inline AttentionSizes paged_decode_attention(const char* op, const Tensor& q,
                                             const Tensor& k_cache, const Tensor& v_cache,
                                             const Tensor& block_tables,
                                             const Tensor& context_lens, const Tensor* out,
                                             const std::optional<Tensor>& k_scale,
                                             const std::optional<Tensor>& v_scale) {
    const auto shape = q.sym_sizes();
    const ScalarType dtype = q.scalar_type();
    if (shape.size() != 3 || !is_kernel_dtype(dtype)) {
        bad(op, "q", "float32, bfloat16 or float16 [seqs, heads, head_dim]", q);
    }
    auto [block_size, kv_heads, head_dim] = cache(op, dtype, k_cache, v_cache);
    cache_scales(op, k_cache, k_scale, v_scale);
    if (shape[2] != head_dim || shape[1] % kv_heads != 0) {
        bad(op, "q", c10::str("[seqs, a multiple of ", kv_heads, " heads, ", head_dim, "]"), q);
    }
    decode_rows(op, shape[0], block_tables, context_lens);
    if (out) written<3>(op, "out", *out, {shape[0], shape[1], shape[2]}, dtype);
    return {shape[0], shape[1], kv_heads, head_dim, block_size};
}

struct GreedySizes {
    SymInt rows, vocab;
};

inline GreedySizes greedy_logprobs(const char* op, const Tensor& logits) {
    const auto shape = logits.sym_sizes();
    const ScalarType dtype = logits.scalar_type();
    if (shape.size() != 2 || (dtype != ScalarType::Float && dtype != ScalarType::BFloat16) ||
        shape[1] == 0) {
        bad(op, "logits", "float32 or bfloat16 [rows, vocab > 0]", logits);
    }
    return {shape[0], shape[1]};
}

struct RowSizes {
    SymInt rows, columns;
};

// x and weight of RMSNorm; with the residual (read, or also written in place when
// `residual_written`) and the output where given. -> (rows, hidden)
inline RowSizes rms_norm(const char* op, const Tensor& x, const Tensor& weight,
                         const Tensor* residual, const Tensor* out,
                         bool residual_written = false) {
    const auto shape = x.sym_sizes();
    const ScalarType dtype = x.scalar_type();
    if (shape.size() != 2 || !is_kernel_dtype(dtype)) {
        bad(op, "x", "float32, bfloat16 or float16 [rows, hidden]", x);
    }
    const auto w = weight.sym_sizes();
    if (w.size() != 1 || w[0] != shape[1] || weight.scalar_type() != dtype) {
        bad(op, "weight", c10::str(dtype_name(dtype), " [", shape[1], "]"), weight);
    }
    if (residual) {
        if (residual_written) {
            written<2>(op, "residual", *residual, {shape[0], shape[1]}, dtype);
        } else if (!residual->sym_sizes().equals(shape) || residual->scalar_type() != dtype) {
            bad(op, "residual", c10::str(dtype_name(dtype), ' ', shape), *residual);
        }
    }
    if (out) written<2>(op, "out", *out, {shape[0], shape[1]}, dtype);
    return {shape[0], shape[1]};
}

// -> (rows, inter)
inline RowSizes silu_mul(const char* op, const Tensor& x, const Tensor* out) {
    const auto shape = x.sym_sizes();
    if (shape.size() != 2 || shape[1] % 2 != 0 || !is_kernel_dtype(x.scalar_type())) {
        bad(op, "x", "float32, bfloat16 or float16 [rows, 2 * inter] (gate | up)", x);
    }
    SymInt inter = shape[1] / 2;
    if (out) written<2>(op, "out", *out, {shape[0], inter}, x.scalar_type());
    return {shape[0], inter};
}

struct HeadSizes {
    SymInt tokens, heads, head_dim;
};

inline HeadSizes rotary_(const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin) {
    const auto shape = x.sym_sizes();
    const ScalarType dtype = x.scalar_type();
    if (shape.size() != 3 || shape[2] % 2 != 0 || x.sym_strides()[1] != shape[2] ||
        x.sym_strides()[2] != 1 || !is_kernel_dtype(dtype)) {
        bad(op, "x",
            "float32, bfloat16 or float16 [tokens, heads, even head_dim], each token's heads "
            "packed (strides *, head_dim, 1)",
            x);
    }
    cos_sin(op, cos, sin, shape[0], shape[2], dtype);
    return {shape[0], shape[1], shape[2]};
}

struct WriteKvSizes {
    SymInt tokens, head_dim, block_size;
};

inline WriteKvSizes rotary_write_kv(const char* op, const Tensor& qkv, int64_t heads,
                                    int64_t kv_heads, const Tensor& cos, const Tensor& sin,
                                    const Tensor& k_cache, const Tensor& v_cache,
                                    const Tensor& slot_mapping, const Tensor* q_out,
                                    const std::optional<Tensor>& k_scale,
                                    const std::optional<Tensor>& v_scale) {
    const auto shape = qkv.sym_sizes();
    const ScalarType dtype = qkv.scalar_type();
    if (shape.size() != 2 || qkv.sym_strides()[1] != 1 || !is_kernel_dtype(dtype)) {
        bad(op, "qkv",
            "float32, bfloat16 or float16 [tokens, (heads | kv_heads | kv_heads) * head_dim], "
            "each row packed",
            qkv);
    }
    auto [block_size, cache_kv_heads, head_dim] = cache(op, dtype, k_cache, v_cache);
    cache_scales(op, k_cache, k_scale, v_scale);
    if (heads <= 0) fail(op, "heads must be positive, got ", heads);
    if (cache_kv_heads != kv_heads) {
        fail(op, "kv_heads must be the cache's ", cache_kv_heads, ", got ", kv_heads);
    }
    if (head_dim % 2 != 0) {
        bad(op, "k_cache", "of an even head_dim (the rotary pairs its halves)", k_cache);
    }
    const SymInt& tokens = shape[0];
    if (shape[1] < (heads + 2 * kv_heads) * head_dim) {
        bad(op, "qkv",
            c10::str("[tokens, at least (heads ", heads, " + 2 x kv_heads ", kv_heads,
                     ") x head_dim ", head_dim, " columns]"),
            qkv);
    }
    const auto slots = slot_mapping.sym_sizes();
    if (slot_mapping.scalar_type() != ScalarType::Long || slots.size() != 1 ||
        slots[0] != tokens) {
        bad(op, "slot_mapping", c10::str("int64 [", tokens, "]"), slot_mapping);
    }
    cos_sin(op, cos, sin, tokens, head_dim, dtype);
    if (q_out) written<3>(op, "q_out", *q_out, {tokens, SymInt(heads), head_dim}, dtype);
    return {tokens, head_dim, block_size};
}

// rotary_write_kv's arguments, then the decode attention's over q_out, one token per
// sequence. -> (seqs, head_dim, block_size)
inline WriteKvSizes decode_layer_attention(const char* op, const Tensor& qkv, int64_t heads,
                                           int64_t kv_heads, const Tensor& cos,
                                           const Tensor& sin, const Tensor& k_cache,
                                           const Tensor& v_cache, const Tensor& slot_mapping,
                                           const Tensor& block_tables,
                                           const Tensor& context_lens, const Tensor& q_out,
                                           const Tensor& out,
                                           const std::optional<Tensor>& k_scale,
                                           const std::optional<Tensor>& v_scale) {
    WriteKvSizes sizes = rotary_write_kv(op, qkv, heads, kv_heads, cos, sin, k_cache, v_cache,
                                         slot_mapping, &q_out, k_scale, v_scale);
    if (heads % kv_heads != 0) {
        fail(op, "heads (", heads, ") must be a multiple of kv_heads (", kv_heads, ")");
    }
    decode_rows(op, sizes.tokens, block_tables, context_lens);
    written<3>(op, "out", out, {sizes.tokens, SymInt(heads), sizes.head_dim}, qkv.scalar_type());
    return sizes;
}

}  // namespace cadence_ops::checks
