// The C++ kernels as torch operators, torch.ops.cadence.*: this shim is built once against
// torch's headers (cadence/kernels/cpu/builds.py; no vector code, so no per-instruction-
// set copies) and loaded with torch.ops.load_library. Each operator has a schema (what it
// writes is marked (a!)); a CPU implementation that checks its arguments
// (cpu_ops_checks.h), packs the tensors it only reads, and calls the entry point of the
// selected instruction set's library through a function pointer; and a Meta one (the same
// checks, then empty outputs) that FakeTensor tracing runs: torch.compile, export and
// torch.library.opcheck. A kernel's non-zero status is a RuntimeError naming it.
//
// Registered here in C++ rather than in Python because the flat decode step calls four of
// these a layer: the dispatcher reaches a C++ kernel without entering Python, and the
// checks read a tensor's metadata without a Python object per size.
//
//     paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
//                            sliding_window=None, k_scale=None, v_scale=None) -> out
//     paged_decode_attention.out(..., sliding_window, out!, k_scale=None, v_scale=None)
//     greedy_logprobs(logits) -> (ids, logprobs)
//     rms_norm(x, weight, eps) -> out
//     rms_norm.out(x, weight, eps, out!)
//     add_rms_norm(residual, x, weight, eps) -> (out, residual + x)
//     add_rms_norm_(residual!, x, weight, eps, out!)     residual += x, then out = its norm
//     silu_mul(x) -> out
//     silu_mul.out(x, out!)
//     rotary_(x!, cos, sin)
//     rotary_write_kv(qkv, heads, kv_heads, cos, sin, k_cache!, v_cache!, slot_mapping,
//                     k_scale!=None, v_scale!=None) -> q
//     rotary_write_kv.out(..., slot_mapping, q_out!, k_scale!=None, v_scale!=None)
//     decode_layer_attention.out(qkv, heads, kv_heads, cos, sin, k_cache!, v_cache!,
//                                slot_mapping, block_tables, context_lens, scale,
//                                sliding_window, q_out!, out!, k_scale!=None, v_scale!=None)
//     lora_shrink_rows_(x, rows_in, a_idx, ranks, row_adapter, rows, first_row, h!)
//     lora_expand_rows_(y!, h, rows_out, b_idx, piece_ranks, rank_start, out_offset,
//                       row_adapter, rows, first_row)
//     quant_matmul(x, packed, scales, out_features, format) -> y
//     quant_matmul_tiles(x, packed, scales, out_features, format, tiles) -> y
//     amx_available() -> bool
//     float_matmul(x, packed, bias, out_features) -> y
//     bf16_matmul_tiles(x, packed, bias, out_features, tiles) -> y
//     bf16_matmul_tiles_swiglu(x, packed, inter, tiles) -> y
//     amx_bf16_available() -> bool
//     use_attention_tiles(tiles, min_rows=1) -> (previous tiles, previous min_rows)
//
// The LoRA pair covers some rows of a step (rows[i], or first_row + i when rows is None;
// row_adapter[i] their adapters, -1 none), reading the adapters' rows in place in the KV
// pool (rows_in, rows_out: the pool read at one width); their index values are checked
// against the pool (lora_checks.h).
//
// quant_matmul multiplies by an int4 (format 0) or int8 (format 1) weight packed by
// cadence/quant/cpu_gemm.py, its activations quantized to int8 on the way in
// (quant_kernels.cpp; quant_checks.h). quant_matmul_tiles is the same product on AMX-INT8
// tiles (quant_amx.h), bitwise equal to it: tiles 1 the hardware's (where amx_available(),
// which asks the selected kernels, and with them Linux, once), 2 their emulation (any CPU
// running the avx512_bf16 kernels, the only ones with the AMX kernel).
//
// float_matmul multiplies float32 rows by a float32 weight packed in panels of 16 output
// columns by cadence/layers/packed.py (float_kernels.cpp; float_checks.h), each output one
// FMA chain over the input columns in order: the same bits in every library, and for a row
// whatever the other rows.
//
// bf16_matmul_tiles multiplies bfloat16 rows by a bfloat16 weight packed as AMX's B tiles by
// cadence/layers/packed.py (bf16_kernels.cpp; bf16_checks.h) on AMX-BF16 tiles: 1 the
// hardware's (where amx_bf16_available()), 2 their emulation (any CPU running the
// avx512_bf16 kernels, the only ones with the kernel). Each output one tdpbf16ps chain over
// the input columns in order: a row's bits whatever the other rows.
// bf16_matmul_tiles_swiglu multiplies by a fused gate/up weight (2 inter output features,
// gate then up) the same way and returns SwiGLU of the product, [rows, inter]: the bits of
// bf16_matmul_tiles followed by silu_mul, without the product's rows in between.
//
// use_attention_tiles sets, for this process and the selected kernels, the tiles an int8 KV
// cache's attention runs on under bfloat16 or float16 queries: 0 the VNNI vector code, 1 AMX
// (asks for it, as quant_matmul_tiles does), 2 emulated AMX, for the calls of at least
// min_rows rows over one table (a prompt chunk's tokens; 1: all); the AMX-INT8 kernel gives
// the vector code's bits. Returns the setting it replaced.
//
// k_scale/v_scale: an int8 or fp8 cache's scales (cadence/kv_format.py), None for a float
// cache.
//
// The out= and in-place variants return nothing (the flat decode step writes its reused
// buffers with them); the functional ones return new tensors. The outputs are positional
// arguments, not keyword-only as in ATen's out= overloads: a keyword costs the Python
// side of the dispatcher ~0.6 us a call (callers may still name them).
//
// Which library the operators call is set by _select_kernels(isa, path) (selection.py, at
// start and when the tests switch instruction sets), read back by _selected_kernels().

#include "cpu_kernels.h"
#include "cpu_ops_checks.h"
#include "bf16_checks.h"
#include "float_checks.h"
#include "lora_checks.h"
#include "quant_checks.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <string>
#include <tuple>

namespace cadence_ops {
namespace {

using checks::AttentionSizes;
using checks::on_cpu;
using checks::RowSizes;
using checks::WriteKvSizes;
using at::Tensor;
using c10::ScalarType;
using c10::SymInt;

// ---- the selected library's entry points -------------------------------------------------

struct Kernels {
    std::string isa;
    decltype(&cadence_paged_decode_attention) paged_decode_attention;
    decltype(&cadence_greedy_logprobs) greedy_logprobs;
    decltype(&cadence_rms_norm) rms_norm;
    decltype(&cadence_silu_mul) silu_mul;
    decltype(&cadence_rotary) rotary;
    decltype(&cadence_rotary_write_kv) rotary_write_kv;
    decltype(&cadence_decode_layer_attention) decode_layer_attention;
    decltype(&cadence_lora_shrink) lora_shrink;
    decltype(&cadence_lora_expand) lora_expand;
    decltype(&cadence_quant_matmul) quant_matmul;
    decltype(&cadence_amx_request) amx_request;
    decltype(&cadence_quant_matmul_tiles) quant_matmul_tiles;
    decltype(&cadence_float_matmul) float_matmul;
    decltype(&cadence_amx_bf16_request) amx_bf16_request;
    decltype(&cadence_bf16_matmul_tiles) bf16_matmul_tiles;
    decltype(&cadence_bf16_matmul_tiles_swiglu) bf16_matmul_tiles_swiglu;
    decltype(&cadence_attention_tiles) attention_tiles;
};

// Every call reads the table through one atomic pointer; a selection swaps it. Tables are
// never freed (nor their libraries closed): a call in flight on another thread may still
// hold the previous one, and there are at most one per instruction set.
std::atomic<const Kernels*> selected{nullptr};
std::mutex loading;
std::map<std::string, std::unique_ptr<const Kernels>> loaded;  // by library path

template <typename Entry>
void resolve(void* library, const std::string& path, const char* name, Entry& entry) {
    entry = reinterpret_cast<Entry>(dlsym(library, name));
    TORCH_CHECK(entry, "the CPU kernels ", path, " lack ", name);
}

// Loads the library at `path` (built for `isa`) unless it is already, and makes it the one
// every operator calls. RTLD_LOCAL: the libraries of every instruction set export the same
// names, so none may resolve another's.
void select_kernels(c10::string_view isa, c10::string_view path_view) {
    const std::string path(path_view);
    std::lock_guard<std::mutex> guard(loading);
    auto& table = loaded[path];
    if (!table) {
        void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        TORCH_CHECK(library, "loading the ", isa, " kernels failed: ", dlerror());
        auto fresh = std::make_unique<Kernels>();
        fresh->isa = std::string(isa);
        resolve(library, path, "cadence_paged_decode_attention", fresh->paged_decode_attention);
        resolve(library, path, "cadence_greedy_logprobs", fresh->greedy_logprobs);
        resolve(library, path, "cadence_rms_norm", fresh->rms_norm);
        resolve(library, path, "cadence_silu_mul", fresh->silu_mul);
        resolve(library, path, "cadence_rotary", fresh->rotary);
        resolve(library, path, "cadence_rotary_write_kv", fresh->rotary_write_kv);
        resolve(library, path, "cadence_decode_layer_attention", fresh->decode_layer_attention);
        resolve(library, path, "cadence_lora_shrink", fresh->lora_shrink);
        resolve(library, path, "cadence_lora_expand", fresh->lora_expand);
        resolve(library, path, "cadence_quant_matmul", fresh->quant_matmul);
        resolve(library, path, "cadence_amx_request", fresh->amx_request);
        resolve(library, path, "cadence_quant_matmul_tiles", fresh->quant_matmul_tiles);
        resolve(library, path, "cadence_float_matmul", fresh->float_matmul);
        resolve(library, path, "cadence_amx_bf16_request", fresh->amx_bf16_request);
        resolve(library, path, "cadence_bf16_matmul_tiles", fresh->bf16_matmul_tiles);
        resolve(library, path, "cadence_bf16_matmul_tiles_swiglu", fresh->bf16_matmul_tiles_swiglu);
        resolve(library, path, "cadence_attention_tiles", fresh->attention_tiles);
        table = std::move(fresh);
    }
    selected.store(table.get(), std::memory_order_release);
}

// The file the selected entry points live in, as the dynamic linker names it ("" before
// any selection): what the tests compare with the library they selected.
std::string selected_kernels() {
    const Kernels* table = selected.load(std::memory_order_acquire);
    Dl_info info;
    if (!table || !dladdr(reinterpret_cast<void*>(table->paged_decode_attention), &info)) {
        return "";
    }
    return info.dli_fname;
}

const Kernels& kernels() {
    const Kernels* table = selected.load(std::memory_order_acquire);
    TORCH_CHECK(table, "no CPU kernels are selected (cadence.kernels.cpu.select)");
    return *table;
}

// Raises the error naming the entry point of `table` that returned a non-zero status.
void check_status(const Kernels& table, int status, const char* entry_point) {
    if (status == cadence_kernels::OK) return;
    using namespace cadence_kernels;
    const char* why =
        status == BAD_HEADS ? "the query heads are not a multiple of the KV heads"
        : status == BAD_DTYPE ? "no kernel for the dtypes"
        : status == NO_AMX
            ? "AMX is not usable in this process (the CPU lacks AMX-INT8 or AMX-BF16, or Linux "
              "refused the tile data permission: amx_available() or amx_bf16_available() is "
              "False)"
        : status == NO_AMX_KERNEL ? "these kernels have no AMX kernel (only avx512_bf16's do)"
        : status == BAD_TILES ? "tiles must be 1 (AMX) or 2 (emulated AMX)"
        : status == TILE_FAULT
            ? "the emulated AMX tiles ran an instruction the hardware refuses (a kernel bug)"
            : "an unknown status";
    TORCH_CHECK(false, entry_point, " (", table.isa, " kernels) failed with status ", status,
                ": ", why);
}

// ---- helpers ------------------------------------------------------------------------------

int code(ScalarType t) {
    switch (t) {
        case ScalarType::BFloat16: return cadence_kernels::BF16;
        case ScalarType::Half: return cadence_kernels::F16;
        case ScalarType::Char: return cadence_kernels::I8;
        case ScalarType::Float8_e4m3fn: return cadence_kernels::F8E4M3;
        case ScalarType::Float8_e5m2: return cadence_kernels::F8E5M2;
        default: return cadence_kernels::F32;  // the checks admit no other
    }
}

int threads() { return at::get_num_threads(); }

// A quantized cache's scales as the kernels take them (null for a float cache; the checks
// made them float32 and, per slot, contiguous).
float* scale_ptr(const std::optional<Tensor>& scale) {
    return scale ? scale->mutable_data_ptr<float>() : nullptr;
}

int64_t as_int(const SymInt& size) { return size.expect_int(); }

// A 2-D index tensor with each row packed (a block table may be a view of a wider one).
c10::MaybeOwned<Tensor> packed_rows(const Tensor& t) {
    return t.stride(1) == 1 ? c10::MaybeOwned<Tensor>::borrowed(t)
                            : c10::MaybeOwned<Tensor>::owned(t.contiguous());
}

// Which implementation a template below is: the CPU one calls the kernel, the Meta one
// (FakeTensor tracing) only checks and makes the outputs.
enum class Impl { CPU, Meta };

// ---- paged decode attention --------------------------------------------------------------

using Scale = std::optional<Tensor>;

void attend(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
            const Tensor& block_tables, const Tensor& context_lens, double scale,
            std::optional<int64_t> window, const Tensor& out, const AttentionSizes& sizes,
            const Scale& k_scale, const Scale& v_scale) {
    const int64_t seqs = as_int(sizes.seqs);
    if (seqs == 0) return;
    const auto q_packed = q.expect_contiguous();
    const auto lens = context_lens.expect_contiguous();
    const auto tables = packed_rows(block_tables);
    const Kernels& k = kernels();
    const int status = k.paged_decode_attention(
        q_packed->const_data_ptr(), out.mutable_data_ptr(), k_cache.const_data_ptr(),
        v_cache.const_data_ptr(), scale_ptr(k_scale), scale_ptr(v_scale),
        tables->const_data_ptr<int64_t>(), tables->stride(0),
        lens->const_data_ptr<int64_t>(), seqs, as_int(sizes.heads), as_int(sizes.kv_heads),
        as_int(sizes.head_dim), as_int(sizes.block_size), static_cast<float>(scale),
        window.value_or(0), code(q.scalar_type()), code(k_cache.scalar_type()), threads());
    check_status(k, status, "cadence_paged_decode_attention");
}

template <Impl I>
Tensor paged_decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& block_tables, const Tensor& context_lens,
                              double scale, std::optional<int64_t> window,
                              const Scale& k_scale, const Scale& v_scale) {
    constexpr const char* op = "paged_decode_attention";
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache},
                    {"block_tables", &block_tables}, {"context_lens", &context_lens}});
    }
    const auto sizes =
        checks::paged_decode_attention(op, q, k_cache, v_cache, block_tables, context_lens,
                                            nullptr, k_scale, v_scale);
    Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
    if constexpr (I == Impl::CPU) {
        attend(q, k_cache, v_cache, block_tables, context_lens, scale, window, out, sizes,
               k_scale, v_scale);
    }
    return out;
}

template <Impl I>
void paged_decode_attention_out(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                const Tensor& block_tables, const Tensor& context_lens,
                                double scale, std::optional<int64_t> window, const Tensor& out,
                                const Scale& k_scale, const Scale& v_scale) {
    constexpr const char* op = "paged_decode_attention.out";
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache},
                    {"block_tables", &block_tables}, {"context_lens", &context_lens},
                    {"out", &out}});
    }
    const auto sizes =
        checks::paged_decode_attention(op, q, k_cache, v_cache, block_tables, context_lens,
                                            &out, k_scale, v_scale);
    if constexpr (I == Impl::CPU) {
        attend(q, k_cache, v_cache, block_tables, context_lens, scale, window, out, sizes,
               k_scale, v_scale);
    }
}

// ---- greedy sampling ---------------------------------------------------------------------

template <Impl I>
std::tuple<Tensor, Tensor> greedy_logprobs(const Tensor& logits) {
    constexpr const char* op = "greedy_logprobs";
    if constexpr (I == Impl::Meta) on_cpu(op, {{"logits", &logits}});
    const auto [rows, vocab] = checks::greedy_logprobs(op, logits);
    Tensor ids = at::empty_symint({rows}, logits.options().dtype(at::kLong));
    Tensor logprobs = at::empty_symint({rows}, logits.options().dtype(at::kFloat));
    if constexpr (I == Impl::CPU) {
        if (as_int(rows) != 0) {
            const auto packed = logits.expect_contiguous();
            const Kernels& k = kernels();
            const int status = k.greedy_logprobs(
                packed->const_data_ptr(), as_int(rows), as_int(vocab),
                ids.mutable_data_ptr<int64_t>(), logprobs.mutable_data_ptr<float>(),
                code(logits.scalar_type()), threads());
            check_status(k, status, "cadence_greedy_logprobs");
        }
    }
    return {ids, logprobs};
}

// ---- RMSNorm, with or without the residual add --------------------------------------------

// out = RMSNorm(x (+ residual)), residual_out = x + residual; x, residual and weight packed.
void normalize(const Tensor& x, const Tensor* residual, const Tensor& weight, const Tensor& out,
               const Tensor* residual_out, const RowSizes& sizes, double eps) {
    const auto x_packed = x.expect_contiguous();
    const auto weight_packed = weight.expect_contiguous();
    c10::MaybeOwned<Tensor> residual_packed;
    if (residual) residual_packed = residual->expect_contiguous();
    const Kernels& k = kernels();
    const int status = k.rms_norm(
        x_packed->const_data_ptr(), residual ? residual_packed->const_data_ptr() : nullptr,
        weight_packed->const_data_ptr(), out.mutable_data_ptr(),
        residual_out ? residual_out->mutable_data_ptr() : nullptr, as_int(sizes.rows),
        as_int(sizes.columns), static_cast<float>(eps), code(x.scalar_type()), threads());
    check_status(k, status, "cadence_rms_norm");
}

template <Impl I>
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
    constexpr const char* op = "rms_norm";
    if constexpr (I == Impl::Meta) on_cpu(op, {{"x", &x}, {"weight", &weight}});
    const auto sizes = checks::rms_norm(op, x, weight, nullptr, nullptr);
    Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
    if constexpr (I == Impl::CPU) normalize(x, nullptr, weight, out, nullptr, sizes, eps);
    return out;
}

template <Impl I>
void rms_norm_out(const Tensor& x, const Tensor& weight, double eps, const Tensor& out) {
    constexpr const char* op = "rms_norm.out";
    if constexpr (I == Impl::Meta) on_cpu(op, {{"x", &x}, {"weight", &weight}, {"out", &out}});
    const auto sizes = checks::rms_norm(op, x, weight, nullptr, &out);
    if constexpr (I == Impl::CPU) normalize(x, nullptr, weight, out, nullptr, sizes, eps);
}

template <Impl I>
std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& residual, const Tensor& x,
                                        const Tensor& weight, double eps) {
    constexpr const char* op = "add_rms_norm";
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"residual", &residual}, {"x", &x}, {"weight", &weight}});
    }
    const auto sizes = checks::rms_norm(op, x, weight, &residual, nullptr);
    Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
    Tensor residual_out = at::empty_like(x, at::MemoryFormat::Contiguous);
    if constexpr (I == Impl::CPU) normalize(x, &residual, weight, out, &residual_out, sizes, eps);
    return {out, residual_out};
}

template <Impl I>
void add_rms_norm_(const Tensor& residual, const Tensor& x, const Tensor& weight, double eps,
                   const Tensor& out) {
    constexpr const char* op = "add_rms_norm_";
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"residual", &residual}, {"x", &x}, {"weight", &weight}, {"out", &out}});
    }
    const auto sizes = checks::rms_norm(op, x, weight, &residual, &out, true);
    if constexpr (I == Impl::CPU) normalize(x, &residual, weight, out, &residual, sizes, eps);
}

// ---- SwiGLU ------------------------------------------------------------------------------

void swiglu(const Tensor& x, const Tensor& out, const RowSizes& sizes) {
    const auto packed = x.expect_contiguous();
    const Kernels& k = kernels();
    const int status = k.silu_mul(
        packed->const_data_ptr(), out.mutable_data_ptr(), as_int(sizes.rows),
        as_int(sizes.columns), code(x.scalar_type()), threads());
    check_status(k, status, "cadence_silu_mul");
}

template <Impl I>
Tensor silu_mul(const Tensor& x) {
    constexpr const char* op = "silu_mul";
    if constexpr (I == Impl::Meta) on_cpu(op, {{"x", &x}});
    const auto sizes = checks::silu_mul(op, x, nullptr);
    Tensor out = at::empty_symint({sizes.rows, sizes.columns}, x.options());
    if constexpr (I == Impl::CPU) swiglu(x, out, sizes);
    return out;
}

template <Impl I>
void silu_mul_out(const Tensor& x, const Tensor& out) {
    constexpr const char* op = "silu_mul.out";
    if constexpr (I == Impl::Meta) on_cpu(op, {{"x", &x}, {"out", &out}});
    const auto sizes = checks::silu_mul(op, x, &out);
    if constexpr (I == Impl::CPU) swiglu(x, out, sizes);
}

// ---- rotary embedding, alone or with the KV-cache write (and the decode attention) --------

template <Impl I>
void rotary_(const Tensor& x, const Tensor& cos, const Tensor& sin) {
    constexpr const char* op = "rotary_";
    if constexpr (I == Impl::Meta) on_cpu(op, {{"x", &x}, {"cos", &cos}, {"sin", &sin}});
    const auto sizes = checks::rotary_(op, x, cos, sin);
    if constexpr (I == Impl::CPU) {
        const auto cos_packed = cos.expect_contiguous();
        const auto sin_packed = sin.expect_contiguous();
        const Kernels& k = kernels();
        const int status = k.rotary(
            x.mutable_data_ptr(), as_int(sizes.tokens), as_int(sizes.heads),
            as_int(sizes.head_dim), x.stride(0), cos_packed->const_data_ptr(),
            sin_packed->const_data_ptr(), code(x.scalar_type()), threads());
        check_status(k, status, "cadence_rotary");
    }
}

void write_kv(const Tensor& qkv, int64_t heads, int64_t kv_heads, const Tensor& cos,
              const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache,
              const Tensor& slot_mapping, const Tensor& q_out, const WriteKvSizes& sizes,
              const Scale& k_scale, const Scale& v_scale) {
    const auto cos_packed = cos.expect_contiguous();
    const auto sin_packed = sin.expect_contiguous();
    const auto slots = slot_mapping.expect_contiguous();
    const Kernels& k = kernels();
    const int status = k.rotary_write_kv(
        qkv.const_data_ptr(), as_int(sizes.tokens), qkv.stride(0), heads, kv_heads,
        as_int(sizes.head_dim), cos_packed->const_data_ptr(), sin_packed->const_data_ptr(),
        q_out.mutable_data_ptr(), k_cache.mutable_data_ptr(), v_cache.mutable_data_ptr(),
        scale_ptr(k_scale), scale_ptr(v_scale), slots->const_data_ptr<int64_t>(),
        code(qkv.scalar_type()), code(k_cache.scalar_type()), threads());
    check_status(k, status, "cadence_rotary_write_kv");
}

template <Impl I>
Tensor rotary_write_kv(const Tensor& qkv, int64_t heads, int64_t kv_heads, const Tensor& cos,
                       const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& slot_mapping, const Scale& k_scale, const Scale& v_scale) {
    constexpr const char* op = "rotary_write_kv";
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"qkv", &qkv}, {"cos", &cos}, {"sin", &sin}, {"k_cache", &k_cache},
                    {"v_cache", &v_cache}, {"slot_mapping", &slot_mapping}});
    }
    const auto sizes = checks::rotary_write_kv(op, qkv, heads, kv_heads, cos, sin, k_cache,
                                                    v_cache, slot_mapping, nullptr, k_scale,
                                                    v_scale);
    Tensor q_out = at::empty_symint({sizes.tokens, heads, sizes.head_dim}, qkv.options());
    if constexpr (I == Impl::CPU) {
        write_kv(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slot_mapping, q_out, sizes,
                 k_scale, v_scale);
    }
    return q_out;
}

template <Impl I>
void rotary_write_kv_out(const Tensor& qkv, int64_t heads, int64_t kv_heads, const Tensor& cos,
                         const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache,
                         const Tensor& slot_mapping, const Tensor& q_out, const Scale& k_scale,
                         const Scale& v_scale) {
    constexpr const char* op = "rotary_write_kv.out";
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"qkv", &qkv}, {"cos", &cos}, {"sin", &sin}, {"k_cache", &k_cache},
                    {"v_cache", &v_cache}, {"slot_mapping", &slot_mapping}, {"q_out", &q_out}});
    }
    const auto sizes = checks::rotary_write_kv(op, qkv, heads, kv_heads, cos, sin, k_cache,
                                                    v_cache, slot_mapping, &q_out, k_scale,
                                                    v_scale);
    if constexpr (I == Impl::CPU) {
        write_kv(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slot_mapping, q_out, sizes,
                 k_scale, v_scale);
    }
}

template <Impl I>
void decode_layer_attention_out(const Tensor& qkv, int64_t heads, int64_t kv_heads,
                                const Tensor& cos, const Tensor& sin, const Tensor& k_cache,
                                const Tensor& v_cache, const Tensor& slot_mapping,
                                const Tensor& block_tables, const Tensor& context_lens,
                                double scale, std::optional<int64_t> window,
                                const Tensor& q_out, const Tensor& out, const Scale& k_scale,
                                const Scale& v_scale) {
    constexpr const char* op = "decode_layer_attention.out";
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"qkv", &qkv}, {"cos", &cos}, {"sin", &sin}, {"k_cache", &k_cache},
                    {"v_cache", &v_cache}, {"slot_mapping", &slot_mapping},
                    {"block_tables", &block_tables}, {"context_lens", &context_lens},
                    {"q_out", &q_out}, {"out", &out}});
    }
    const auto sizes = checks::decode_layer_attention(op, qkv, heads, kv_heads, cos, sin,
                                                           k_cache, v_cache, slot_mapping,
                                                           block_tables, context_lens, q_out, out,
                                                           k_scale, v_scale);
    if constexpr (I == Impl::CPU) {
        const int64_t seqs = as_int(sizes.tokens);
        if (seqs == 0) return;
        const auto cos_packed = cos.expect_contiguous();
        const auto sin_packed = sin.expect_contiguous();
        const auto slots = slot_mapping.expect_contiguous();
        const auto lens = context_lens.expect_contiguous();
        const auto tables = packed_rows(block_tables);
        const Kernels& k = kernels();
        const int status = k.decode_layer_attention(
            qkv.const_data_ptr(), qkv.stride(0), cos_packed->const_data_ptr(),
            sin_packed->const_data_ptr(), q_out.mutable_data_ptr(), out.mutable_data_ptr(),
            k_cache.mutable_data_ptr(), v_cache.mutable_data_ptr(), scale_ptr(k_scale),
            scale_ptr(v_scale), slots->const_data_ptr<int64_t>(), tables->const_data_ptr<int64_t>(),
            tables->stride(0), lens->const_data_ptr<int64_t>(), seqs, heads, kv_heads,
            as_int(sizes.head_dim), as_int(sizes.block_size), static_cast<float>(scale),
            window.value_or(0), code(qkv.scalar_type()), code(k_cache.scalar_type()), threads());
        check_status(k, status, "cadence_decode_layer_attention");
    }
}

// ---- LoRA over some rows of a step, the adapters' rows read in the pool -------------------

// An index tensor as the kernels read it: int64, packed (int32 tables are widened).
c10::MaybeOwned<Tensor> as_index(const Tensor& t) {
    if (t.scalar_type() == ScalarType::Long) return t.expect_contiguous();
    return c10::MaybeOwned<Tensor>::owned(t.to(ScalarType::Long).contiguous());
}

// A 2-D tensor the kernel only reads, each row packed (rows may be any distance apart).
c10::MaybeOwned<Tensor> packed_columns(const Tensor& t) {
    return t.size(1) <= 1 || t.stride(1) == 1 ? c10::MaybeOwned<Tensor>::borrowed(t)
                                              : c10::MaybeOwned<Tensor>::owned(t.contiguous());
}

// The selection's tensors checked for the device (Meta) and read as int64 (CPU).
struct RowSelection {
    c10::MaybeOwned<Tensor> adapters, rows;
    const int64_t* rows_ptr() const {
        return rows->defined() ? rows->const_data_ptr<int64_t>() : nullptr;
    }
};

RowSelection selection(const char* op, const Tensor& row_adapter,
                       const std::optional<Tensor>& rows, int64_t n, int64_t tokens,
                       int64_t adapters) {
    RowSelection s{as_index(row_adapter),
                   rows ? as_index(*rows) : c10::MaybeOwned<Tensor>::owned(Tensor())};
    lora_checks::selection_values(op, s.adapters->const_data_ptr<int64_t>(), s.rows_ptr(), n,
                                  tokens, adapters);
    return s;
}

template <Impl I>
void lora_shrink_rows_(const Tensor& x, const Tensor& rows_in, const Tensor& a_idx,
                       const Tensor& ranks, const Tensor& row_adapter,
                       const std::optional<Tensor>& rows, int64_t first_row, const Tensor& h) {
    constexpr const char* op = "lora_shrink_rows_";
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"x", &x}, {"rows_in", &rows_in}, {"a_idx", &a_idx}, {"ranks", &ranks},
                    {"row_adapter", &row_adapter}, {"h", &h}});
        if (rows) on_cpu(op, {{"x", &x}, {"rows", &*rows}});
    }
    const auto sizes =
        lora_checks::shrink(op, x, rows_in, a_idx, ranks, row_adapter, rows, first_row, h);
    if constexpr (I == Impl::CPU) {
        const int64_t n = as_int(sizes.n), rmax = as_int(sizes.rmax);
        const int64_t adapters = as_int(sizes.adapters);
        if (n == 0) return;
        const auto idx = as_index(a_idx);
        const auto rank = as_index(ranks);
        lora_checks::table_values(op, "a_idx", "ranks", idx->const_data_ptr<int64_t>(),
                                  rank->const_data_ptr<int64_t>(), adapters, rmax,
                                  rows_in.size(0), "rows_in");
        const RowSelection sel =
            selection(op, row_adapter, rows, n, as_int(sizes.tokens), adapters);
        const auto x_rows = packed_columns(x);
        const Kernels& k = kernels();
        const int status = k.lora_shrink(
            x_rows->const_data_ptr(), x_rows->stride(0), rows_in.const_data_ptr(),
            as_int(sizes.in), rows_in.stride(0), idx->const_data_ptr<int64_t>(), rmax,
            rank->const_data_ptr<int64_t>(), sel.adapters->const_data_ptr<int64_t>(),
            sel.rows_ptr(), first_row, n, h.mutable_data_ptr(), code(x.scalar_type()),
            threads());
        check_status(k, status, "cadence_lora_shrink");
    }
}

template <Impl I>
void lora_expand_rows_(const Tensor& y, const Tensor& h, const Tensor& rows_out,
                       const Tensor& b_idx, const Tensor& piece_ranks, const Tensor& rank_start,
                       int64_t out_offset, const Tensor& row_adapter,
                       const std::optional<Tensor>& rows, int64_t first_row) {
    constexpr const char* op = "lora_expand_rows_";
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"y", &y}, {"h", &h}, {"rows_out", &rows_out}, {"b_idx", &b_idx},
                    {"piece_ranks", &piece_ranks}, {"rank_start", &rank_start},
                    {"row_adapter", &row_adapter}});
        if (rows) on_cpu(op, {{"y", &y}, {"rows", &*rows}});
    }
    const auto sizes = lora_checks::expand(op, y, h, rows_out, b_idx, piece_ranks, rank_start,
                                           out_offset, row_adapter, rows, first_row);
    if constexpr (I == Impl::CPU) {
        const int64_t n = as_int(sizes.n), adapters = as_int(sizes.adapters);
        if (n == 0) return;
        const auto idx = as_index(b_idx);
        const auto rank = as_index(piece_ranks);
        const auto start = as_index(rank_start);
        const int64_t width = b_idx.size(1);
        lora_checks::table_values(op, "b_idx", "piece_ranks", idx->const_data_ptr<int64_t>(),
                                  rank->const_data_ptr<int64_t>(), adapters, width,
                                  rows_out.size(0), "rows_out");
        lora_checks::rank_start_values(op, start->const_data_ptr<int64_t>(),
                                       rank->const_data_ptr<int64_t>(), adapters,
                                       as_int(sizes.rank_width));
        const RowSelection sel =
            selection(op, row_adapter, rows, n, as_int(sizes.tokens), adapters);
        const auto h_rows = packed_columns(h);
        const Kernels& k = kernels();
        const int status = k.lora_expand(
            y.mutable_data_ptr(), y.stride(0), out_offset, h_rows->const_data_ptr(),
            h_rows->stride(0), rows_out.const_data_ptr(), as_int(sizes.out), rows_out.stride(0),
            idx->const_data_ptr<int64_t>(), width, rank->const_data_ptr<int64_t>(),
            start->const_data_ptr<int64_t>(), sel.adapters->const_data_ptr<int64_t>(),
            sel.rows_ptr(), first_row, n, code(y.scalar_type()), threads());
        check_status(k, status, "cadence_lora_expand");
    }
}

// ---- quantized weights ---------------------------------------------------------------------

// Whether the selected kernels may run AMX-INT8 in this process (they ask once).
bool amx_available() { return kernels().amx_request() == 1; }

// quant_matmul (tiles 0) and quant_matmul_tiles (1: AMX, 2: emulated AMX).
template <Impl I>
Tensor quant_product(const char* op, const Tensor& x, const Tensor& packed,
                     const Tensor& scales, int64_t out_features, int64_t format, int64_t tiles) {
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"x", &x}, {"packed", &packed}, {"scales", &scales}});
    }
    const auto sizes = quant_checks::quant_matmul(op, x, packed, scales, out_features, format);
    if (tiles != 0 && tiles != cadence_kernels::TILES_AMX &&
        tiles != cadence_kernels::TILES_EMULATED) {
        checks::fail(op, "tiles must be 1 (AMX) or 2 (emulated AMX), got ", tiles);
    }
    Tensor y = at::empty_symint({sizes.rows, SymInt(out_features)}, x.options());
    if constexpr (I == Impl::CPU) {
        const int64_t rows = as_int(sizes.rows), in = as_int(sizes.in);
        if (rows == 0 && tiles == 0) return y;
        const Kernels& k = kernels();
        // the kernels run AMX once asked (the answer kept): a caller need not ask first
        if (tiles == cadence_kernels::TILES_AMX) k.amx_request();
        const auto x_rows = packed_columns(x);
        const void* xp = x_rows->const_data_ptr();
        const float* sp = scales.const_data_ptr<float>();
        const int fmt = static_cast<int>(format), dtype = code(x.scalar_type());
        if (tiles == 0) {
            const int status =
                k.quant_matmul(xp, x_rows->stride(0), rows, in, packed.const_data_ptr(), sp,
                               out_features, fmt, y.mutable_data_ptr(), out_features, dtype,
                               threads());
            check_status(k, status, "cadence_quant_matmul");
        } else {  // even with no rows: tiles 1 without AMX fails whatever the input
            const int status = k.quant_matmul_tiles(
                xp, x_rows->stride(0), rows, in, packed.const_data_ptr(), sp, out_features, fmt,
                y.mutable_data_ptr(), out_features, dtype, threads(), static_cast<int>(tiles));
            check_status(k, status, "cadence_quant_matmul_tiles");
        }
    }
    return y;
}

template <Impl I>
Tensor quant_matmul(const Tensor& x, const Tensor& packed, const Tensor& scales,
                    int64_t out_features, int64_t format) {
    return quant_product<I>("quant_matmul", x, packed, scales, out_features, format, 0);
}

template <Impl I>
Tensor quant_matmul_tiles(const Tensor& x, const Tensor& packed, const Tensor& scales,
                          int64_t out_features, int64_t format, int64_t tiles) {
    return quant_product<I>("quant_matmul_tiles", x, packed, scales, out_features, format,
                            tiles);
}

// ---- float32 weights -----------------------------------------------------------------------

template <Impl I>
Tensor float_matmul(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias,
                    int64_t out_features) {
    constexpr const char* op = "float_matmul";
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"x", &x}, {"packed", &packed}});
    }
    const auto sizes = float_checks::float_matmul(op, x, packed, bias, out_features);
    Tensor y = at::empty_symint({sizes.rows, SymInt(out_features)}, x.options());
    if constexpr (I == Impl::CPU) {
        const int64_t rows = as_int(sizes.rows), in = as_int(sizes.in);
        if (reinterpret_cast<uintptr_t>(packed.const_data_ptr()) % 32 != 0) {
            checks::fail(op, "packed must start on a 32-byte boundary (the tiles' aligned loads)");
        }
        if (rows == 0) return y;
        const auto x_rows = packed_columns(x);
        const Kernels& k = kernels();
        const int status = k.float_matmul(x_rows->const_data_ptr<float>(), x_rows->stride(0), rows,
                                          in, packed.const_data_ptr<float>(), out_features,
                                          y.mutable_data_ptr<float>(), out_features, threads());
        check_status(k, status, "cadence_float_matmul");
        if (bias.has_value()) y.add_(*bias);
    }
    return y;
}

// ---- bfloat16 weights on AMX tiles -------------------------------------------------------

// Whether the selected kernels may run AMX-BF16 in this process (they ask once).
bool amx_bf16_available() { return kernels().amx_bf16_request() == 1; }

// The AMX products' `tiles`: 1 the hardware's, 2 their emulation.
void check_tiles(const char* op, int64_t tiles) {
    if (tiles != cadence_kernels::TILES_AMX && tiles != cadence_kernels::TILES_EMULATED) {
        checks::fail(op, "tiles must be 1 (AMX) or 2 (emulated AMX), got ", tiles);
    }
}

template <Impl I>
Tensor bf16_matmul_tiles(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias,
                         int64_t out_features, int64_t tiles) {
    constexpr const char* op = "bf16_matmul_tiles";
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"x", &x}, {"packed", &packed}});
    }
    const auto sizes = bf16_checks::bf16_matmul(op, x, packed, bias, out_features);
    check_tiles(op, tiles);
    Tensor y = at::empty_symint({sizes.rows, SymInt(out_features)}, x.options());
    if constexpr (I == Impl::CPU) {
        const int64_t rows = as_int(sizes.rows), in = as_int(sizes.in);
        const Kernels& k = kernels();
        if (tiles == cadence_kernels::TILES_AMX) k.amx_bf16_request();  // asked once, kept
        const auto x_rows = packed_columns(x);
        const auto* xp = static_cast<const uint16_t*>(x_rows->const_data_ptr());
        const auto* wp = static_cast<const uint16_t*>(packed.const_data_ptr());
        // even with no rows: tiles 1 without AMX fails whatever the input
        const int status =
            k.bf16_matmul_tiles(xp, x_rows->stride(0), rows, in, wp, out_features,
                                static_cast<uint16_t*>(y.mutable_data_ptr()), out_features,
                                threads(), static_cast<int>(tiles));
        check_status(k, status, "cadence_bf16_matmul_tiles");
        if (bias.has_value()) y.add_(*bias);
    }
    return y;
}

template <Impl I>
Tensor bf16_matmul_tiles_swiglu(const Tensor& x, const Tensor& packed, int64_t inter,
                                int64_t tiles) {
    constexpr const char* op = "bf16_matmul_tiles_swiglu";
    if constexpr (I == Impl::Meta) {
        on_cpu(op, {{"x", &x}, {"packed", &packed}});
    }
    if (inter <= 0 || inter % bf16_checks::COLS != 0) {
        checks::fail(op, "inter must be a positive multiple of 16, got ", inter);
    }
    const auto sizes = bf16_checks::bf16_matmul(op, x, packed, std::nullopt, 2 * inter);
    check_tiles(op, tiles);
    Tensor y = at::empty_symint({sizes.rows, SymInt(inter)}, x.options());
    if constexpr (I == Impl::CPU) {
        const int64_t rows = as_int(sizes.rows), in = as_int(sizes.in);
        const Kernels& k = kernels();
        if (tiles == cadence_kernels::TILES_AMX) k.amx_bf16_request();  // asked once, kept
        const auto x_rows = packed_columns(x);
        const int status = k.bf16_matmul_tiles_swiglu(
            static_cast<const uint16_t*>(x_rows->const_data_ptr()), x_rows->stride(0), rows, in,
            static_cast<const uint16_t*>(packed.const_data_ptr()), inter,
            static_cast<uint16_t*>(y.mutable_data_ptr()), inter, threads(),
            static_cast<int>(tiles));
        check_status(k, status, "cadence_bf16_matmul_tiles_swiglu");
    }
    return y;
}

// ---- a step's layers in one call ---------------------------------------------------------

// How decode_layers multiplies by one of a layer's weights: the kernel its Python loop
// would call (cadence.runners.llama_cpu_flat), by code.
enum LayerProduct : int64_t { AMX_BF16 = 0, INTEGER = 1, FLOAT_TILES = 2 };
constexpr int64_t LAYER_TENSORS = 10;  // two norms, then a (packed, scales) pair per product
constexpr int64_t LAYER_SPECS = 16;    // (kind, out_features, format, tiles) per product

// x @ W.T by the product `spec` (kind, out_features, format, tiles) names: cadence's
// AMX-BF16 tiles, the integer product (quant_matmul, or quant_matmul_tiles on AMX-INT8),
// or cadence's float32 tiles -- each its operator's own checks and call.
template <Impl I>
Tensor layer_product(const Tensor& x, const Tensor& packed, const Tensor& scales,
                     const int64_t* spec) {
    switch (spec[0]) {
        case AMX_BF16: return bf16_matmul_tiles<I>(x, packed, std::nullopt, spec[1], spec[3]);
        case INTEGER:
            return spec[3] == 0 ? quant_matmul<I>(x, packed, scales, spec[1], spec[2])
                                : quant_matmul_tiles<I>(x, packed, scales, spec[1], spec[2], spec[3]);
        case FLOAT_TILES: return float_matmul<I>(x, packed, std::nullopt, spec[1]);
        default: checks::fail("decode_layers", "product kind must be 0, 1 or 2, got ", spec[0]);
    }
}

// The Llama layers of a step whose rows all attend over the cache (decode rows; with batch
// invariance, a prompt's tokens too), each product one call of a kernel here: what
// cadence.runners.llama_cpu_flat does per layer (RMSNorm with the residual add, the QKV
// product, rotary + cache write + attention, the O product, RMSNorm, the gate/up product
// and SwiGLU -- fused on the AMX-BF16 tiles -- the down product), the same operators in
// the same order on the same kind of buffers, so the same bits, without a Python frame and
// seven operator dispatches per layer (about 2 ms of a 32-row decode step of SmolLM2). Per
// layer: `weights` the input and post-attention norms, then QKV's, O's, gate/up's and
// down's packed weight and scales (any tensor where the product has none); `specs` each
// product's (kind, out_features, format, tiles); `caches` K and V; `scales` K's and V's
// (an int8 cache) or none; `windows` the sliding window (0: none). `x`: the previous
// layer's output, None where the first layer is the model's (its input norm then reads
// `residual`, the embedding, without an add). `residual` is updated in place; returns the
// last layer's output (the next call's `x`, or the final norm's input).
template <Impl I>
Tensor decode_layers(const Tensor& residual, const std::optional<Tensor>& x_in,
                     at::TensorList weights, at::IntArrayRef specs, at::TensorList caches,
                     at::TensorList scales, at::IntArrayRef windows, const Tensor& cos,
                     const Tensor& sin, const Tensor& slot_mapping, const Tensor& block_tables,
                     const Tensor& context_lens, int64_t heads, int64_t kv_heads, double scale,
                     double eps) {
    constexpr const char* op = "decode_layers";
    const int64_t layers = static_cast<int64_t>(windows.size());
    if (layers == 0 || static_cast<int64_t>(weights.size()) != LAYER_TENSORS * layers ||
        static_cast<int64_t>(specs.size()) != LAYER_SPECS * layers ||
        static_cast<int64_t>(caches.size()) != 2 * layers ||
        (!scales.empty() && static_cast<int64_t>(scales.size()) != 2 * layers)) {
        checks::fail(op, "for ", layers, " layers (windows, at least 1) expected ",
                     LAYER_TENSORS, " weights, ", LAYER_SPECS, " specs, 2 caches and 0 or 2 ",
                     "scales each, got ", weights.size(), ", ", specs.size(), ", ",
                     caches.size(), ", ", scales.size());
    }
    if (residual.dim() != 2 || heads <= 0 || kv_heads <= 0) {
        checks::fail(op, "residual must be [tokens, hidden] and heads, kv_heads positive");
    }
    if constexpr (I == Impl::Meta) {
        return at::empty_like(residual, at::MemoryFormat::Contiguous);
    } else {
        const int64_t tokens = residual.size(0);
        const int64_t head_dim = specs[1] / (heads + 2 * kv_heads);
        // the buffers every layer reuses, as the Python loop's
        const Tensor normed = at::empty_like(residual, at::MemoryFormat::Contiguous);
        const Tensor q_out = at::empty({tokens, heads, head_dim}, residual.options());
        const Tensor attended = at::empty({tokens, heads, head_dim}, residual.options());
        Tensor act;  // the SwiGLU of an unfused gate/up product
        Tensor x = x_in.has_value() ? *x_in : residual;
        for (int64_t l = 0; l < layers; ++l) {
            const Tensor* w = weights.data() + LAYER_TENSORS * l;
            const int64_t* spec = specs.data() + LAYER_SPECS * l;  // qkv, o, gate/up, down
            if (l == 0 && !x_in.has_value()) rms_norm_out<I>(x, w[0], eps, normed);
            else add_rms_norm_<I>(residual, x, w[0], eps, normed);
            const Tensor qkv = layer_product<I>(normed, w[2], w[3], spec);
            const Scale k_scale = scales.empty() ? Scale{} : Scale{scales[2 * l]};
            const Scale v_scale = scales.empty() ? Scale{} : Scale{scales[2 * l + 1]};
            const std::optional<int64_t> window =
                windows[l] > 0 ? std::optional<int64_t>{windows[l]} : std::nullopt;
            decode_layer_attention_out<I>(qkv, heads, kv_heads, cos, sin, caches[2 * l],
                                          caches[2 * l + 1], slot_mapping, block_tables,
                                          context_lens, scale, window, q_out, attended, k_scale,
                                          v_scale);
            x = layer_product<I>(attended.view({tokens, heads * head_dim}), w[4], w[5], spec + 4);
            add_rms_norm_<I>(residual, x, w[1], eps, normed);
            const int64_t* gate_up = spec + 8;
            Tensor swiglu;
            if (gate_up[0] == AMX_BF16) {
                swiglu = bf16_matmul_tiles_swiglu<I>(normed, w[6], gate_up[1] / 2, gate_up[3]);
            } else {
                const Tensor both = layer_product<I>(normed, w[6], w[7], gate_up);
                if (!act.defined()) act = at::empty({tokens, gate_up[1] / 2}, residual.options());
                silu_mul_out<I>(both, act);
                swiglu = act;
            }
            x = layer_product<I>(swiglu, w[8], w[9], spec + 12);
        }
        return x;
    }
}

// ---- the int8 cache's attention on AMX tiles ---------------------------------------------

std::tuple<int64_t, int64_t> use_attention_tiles(int64_t tiles, int64_t min_rows) {
    if (tiles != 0 && tiles != cadence_kernels::TILES_AMX &&
        tiles != cadence_kernels::TILES_EMULATED) {
        checks::fail("use_attention_tiles",
                     "tiles must be 0 (vector), 1 (AMX) or 2 (emulated AMX), got ", tiles);
    }
    if (min_rows < 1 || min_rows > 1 << 20) {
        checks::fail("use_attention_tiles", "min_rows must be at least 1, got ", min_rows);
    }
    const Kernels& k = kernels();
    int previous = 0, previous_min_rows = 1;
    const int status = k.attention_tiles(static_cast<int>(tiles), static_cast<int>(min_rows),
                                         &previous, &previous_min_rows);
    check_status(k, status, "cadence_attention_tiles");
    return {previous, previous_min_rows};
}

}  // namespace
}  // namespace cadence_ops

// ---- registration ------------------------------------------------------------------------

// A fragment: other libraries may add operators to the `cadence` namespace too.
// The arguments several schemas share.
#define CADENCE_ATTENTION                                                                  \
    "Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, " \
    "float scale, int? sliding_window"
#define CADENCE_WRITE_KV                                                                   \
    "Tensor qkv, int heads, int kv_heads, Tensor cos, Tensor sin, Tensor(a!) k_cache, "    \
    "Tensor(b!) v_cache, Tensor slot_mapping"
// A quantized cache's scales, last and optional so that a float cache's calls stay as they
// were: read by the attention, written (int8) by the cache writes.
#define CADENCE_READ_SCALES ", Tensor? k_scale=None, Tensor? v_scale=None"
#define CADENCE_WRITE_SCALES ", Tensor(e!)? k_scale=None, Tensor(f!)? v_scale=None"

// A fragment: other libraries may add operators to the `cadence` namespace too.
TORCH_LIBRARY_FRAGMENT(cadence, m) {
    m.def("paged_decode_attention(" CADENCE_ATTENTION "=None" CADENCE_READ_SCALES ") -> Tensor");
    m.def("paged_decode_attention.out(" CADENCE_ATTENTION ", Tensor(a!) out" CADENCE_READ_SCALES
          ") -> ()");
    m.def("greedy_logprobs(Tensor logits) -> (Tensor, Tensor)");
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("rms_norm.out(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
    m.def("add_rms_norm(Tensor residual, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
    m.def(
        "add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps, "
        "Tensor(b!) out) -> ()");
    m.def("silu_mul(Tensor x) -> Tensor");
    m.def("silu_mul.out(Tensor x, Tensor(a!) out) -> ()");
    m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
    m.def("rotary_write_kv(" CADENCE_WRITE_KV CADENCE_WRITE_SCALES ") -> Tensor");
    m.def("rotary_write_kv.out(" CADENCE_WRITE_KV ", Tensor(c!) q_out" CADENCE_WRITE_SCALES
          ") -> ()");
    m.def("decode_layer_attention.out(" CADENCE_WRITE_KV
          ", Tensor block_tables, Tensor context_lens, float scale, int? sliding_window, "
          "Tensor(c!) q_out, Tensor(d!) out" CADENCE_WRITE_SCALES ") -> ()");
    m.def(
        "lora_shrink_rows_(Tensor x, Tensor rows_in, Tensor a_idx, Tensor ranks, "
        "Tensor row_adapter, Tensor? rows, int first_row, Tensor(a!) h) -> ()");
    m.def(
        "lora_expand_rows_(Tensor(a!) y, Tensor h, Tensor rows_out, Tensor b_idx, "
        "Tensor piece_ranks, Tensor rank_start, int out_offset, Tensor row_adapter, "
        "Tensor? rows, int first_row) -> ()");
    m.def(
        "quant_matmul(Tensor x, Tensor packed, Tensor scales, int out_features, int format) "
        "-> Tensor");
    m.def(
        "quant_matmul_tiles(Tensor x, Tensor packed, Tensor scales, int out_features, "
        "int format, int tiles) -> Tensor");
    m.def("float_matmul(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
    m.def("amx_available() -> bool", TORCH_FN(cadence_ops::amx_available));
    m.def(
        "bf16_matmul_tiles(Tensor x, Tensor packed, Tensor? bias, int out_features, int tiles) "
        "-> Tensor");
    m.def("bf16_matmul_tiles_swiglu(Tensor x, Tensor packed, int inter, int tiles) -> Tensor");
    m.def(
        "decode_layers(Tensor(a!) residual, Tensor? x, Tensor[] weights, int[] specs, "
        "Tensor(b!)[] caches, Tensor(c!)[] scales, int[] windows, Tensor cos, Tensor sin, "
        "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int heads, "
        "int kv_heads, float scale, float eps) -> Tensor");
    m.def("amx_bf16_available() -> bool", TORCH_FN(cadence_ops::amx_bf16_available));
    m.def("use_attention_tiles(int tiles, int min_rows=1) -> (int, int)",
          TORCH_FN(cadence_ops::use_attention_tiles));
    // No tensors: these run whatever the dispatch keys (a catch-all kernel).
    m.def("_select_kernels(str isa, str path) -> ()", TORCH_FN(cadence_ops::select_kernels));
    m.def("_selected_kernels() -> str", TORCH_FN(cadence_ops::selected_kernels));
}

#define CADENCE_IMPLS(m, I)                                                                  \
    m.impl("paged_decode_attention", TORCH_FN(cadence_ops::paged_decode_attention<I>));       \
    m.impl("paged_decode_attention.out", TORCH_FN(cadence_ops::paged_decode_attention_out<I>)); \
    m.impl("greedy_logprobs", TORCH_FN(cadence_ops::greedy_logprobs<I>));                     \
    m.impl("rms_norm", TORCH_FN(cadence_ops::rms_norm<I>));                                   \
    m.impl("rms_norm.out", TORCH_FN(cadence_ops::rms_norm_out<I>));                           \
    m.impl("add_rms_norm", TORCH_FN(cadence_ops::add_rms_norm<I>));                           \
    m.impl("add_rms_norm_", TORCH_FN(cadence_ops::add_rms_norm_<I>));                         \
    m.impl("silu_mul", TORCH_FN(cadence_ops::silu_mul<I>));                                   \
    m.impl("silu_mul.out", TORCH_FN(cadence_ops::silu_mul_out<I>));                           \
    m.impl("rotary_", TORCH_FN(cadence_ops::rotary_<I>));                                     \
    m.impl("rotary_write_kv", TORCH_FN(cadence_ops::rotary_write_kv<I>));                     \
    m.impl("rotary_write_kv.out", TORCH_FN(cadence_ops::rotary_write_kv_out<I>));             \
    m.impl("decode_layer_attention.out", TORCH_FN(cadence_ops::decode_layer_attention_out<I>)); \
    m.impl("lora_shrink_rows_", TORCH_FN(cadence_ops::lora_shrink_rows_<I>));                 \
    m.impl("lora_expand_rows_", TORCH_FN(cadence_ops::lora_expand_rows_<I>));                 \
    m.impl("quant_matmul", TORCH_FN(cadence_ops::quant_matmul<I>));                           \
    m.impl("quant_matmul_tiles", TORCH_FN(cadence_ops::quant_matmul_tiles<I>));                 \
    m.impl("float_matmul", TORCH_FN(cadence_ops::float_matmul<I>));                           \
    m.impl("bf16_matmul_tiles", TORCH_FN(cadence_ops::bf16_matmul_tiles<I>));                 \
    m.impl("bf16_matmul_tiles_swiglu", TORCH_FN(cadence_ops::bf16_matmul_tiles_swiglu<I>));   \
    m.impl("decode_layers", TORCH_FN(cadence_ops::decode_layers<I>));

TORCH_LIBRARY_IMPL(cadence, CPU, m) { CADENCE_IMPLS(m, cadence_ops::Impl::CPU) }
TORCH_LIBRARY_IMPL(cadence, Meta, m) { CADENCE_IMPLS(m, cadence_ops::Impl::Meta) }
