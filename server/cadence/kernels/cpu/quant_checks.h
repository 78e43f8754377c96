// What quant_matmul (cpu_ops.cpp) requires of its arguments, checked by the CPU and the Meta
// implementation alike (cpu_ops_checks.h's conventions: a ValueError naming the argument).
// The packed weight's layout is quant_kernels.cpp's; its sizes must agree with the input's
// width and the output features, since the kernel walks it through raw pointers.

#pragma once

#include "cpu_ops_checks.h"

namespace cadence_ops::quant_checks {

using at::Tensor;
using c10::ScalarType;
using c10::SymInt;
using checks::bad;
using checks::fail;

constexpr int64_t COLS = 16, BLOCK = 32;  // quant_kernels.cpp's column and input blocks
constexpr int64_t INT4 = 0, INT8 = 1, INT8_BLOCKS = 2;  // cadence_kernels::QuantFormat

struct QuantSizes {
    SymInt rows, in;
};

// x [rows, in] float32 / bfloat16 (any strides: the operator packs its rows); packed uint8
// [n16, k32, 256 (int4) | 512 (int8s)] and scales float32 (int4: [n16, k32, 2, 16]; int8:
// [n16 * 16]; int8 blocks: [n16, k32, 16]), both contiguous; out_features within the last
// column block; the input exactly k32 blocks (int4, int8 blocks) or within the last (int8).
inline QuantSizes quant_matmul(const char* op, const Tensor& x, const Tensor& packed,
                               const Tensor& scales, int64_t out_features, int64_t format) {
    if (format != INT4 && format != INT8 && format != INT8_BLOCKS) {
        fail(op, "format must be 0 (int4), 1 (int8) or 2 (int8 blocks), got ", format);
    }
    const auto shape = x.sym_sizes();
    const ScalarType dtype = x.scalar_type();
    if (shape.size() != 2 || (dtype != ScalarType::Float && dtype != ScalarType::BFloat16)) {
        bad(op, "x", "float32 or bfloat16 [rows, in]", x);
    }
    const int64_t block_bytes = format == INT4 ? 256 : 512;
    const auto w = packed.sym_sizes();
    if (w.size() != 3 || w[2] != block_bytes || packed.scalar_type() != ScalarType::Byte ||
        !packed.is_contiguous()) {
        bad(op, "packed", c10::str("a contiguous uint8 [n16, k32, ", block_bytes, "]"), packed);
    }
    const SymInt& n16 = w[0];
    const SymInt& k32 = w[1];
    const bool scales_ok =
        format == INT4   ? scales.sym_sizes().equals({n16, k32, SymInt(2), SymInt(COLS)})
        : format == INT8 ? scales.sym_sizes().equals({n16 * COLS})
                         : scales.sym_sizes().equals({n16, k32, SymInt(COLS)});
    if (!scales_ok || scales.scalar_type() != ScalarType::Float || !scales.is_contiguous()) {
        bad(op, "scales",
            format == INT4   ? c10::str("a contiguous float32 [", n16, ", ", k32, ", 2, 16]")
            : format == INT8 ? c10::str("a contiguous float32 [", n16 * COLS, "]")
                             : c10::str("a contiguous float32 [", n16, ", ", k32, ", 16]"),
            scales);
    }
    if (out_features <= (n16 - 1) * COLS || out_features > n16 * COLS) {
        fail(op, "out_features ", out_features, " does not fill the packed weight's ", n16,
             " blocks of 16 output features");
    }
    const SymInt& in = shape[1];
    const bool whole_blocks = format != INT8;
    const bool in_ok =
        whole_blocks ? in == k32 * BLOCK : (in > (k32 - 1) * BLOCK && in <= k32 * BLOCK);
    if (!in_ok) {
        bad(op, "x", c10::str(whole_blocks ? "[rows, " : "[rows, at most ", k32 * BLOCK,
                              "] (the packed weight's input blocks of 32)"),
            x);
    }
    return {shape[0], in};
}

}  // namespace cadence_ops::quant_checks
