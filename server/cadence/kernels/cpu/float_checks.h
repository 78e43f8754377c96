// What float_matmul (cpu_ops.cpp) requires of its arguments, checked by the CPU and the Meta
// implementation alike (cpu_ops_checks.h's conventions: a ValueError naming the argument).
// The packed weight's layout is float_kernels.cpp's; its sizes must agree with the input's
// width and the output features, since the kernel walks it through raw pointers.

#pragma once

#include "cpu_ops_checks.h"

namespace cadence_ops::float_checks {

using at::Tensor;
using c10::ScalarType;
using c10::SymInt;
using checks::bad;
using checks::fail;

constexpr int64_t COLS = 16;  // float_kernels.cpp's output columns per panel

struct FloatSizes {
    SymInt rows, in;
};

// x [rows, in] float32 (any strides: the operator packs its rows); packed float32 [n16,
// in, 16], contiguous; out_features within the last panel; bias, when given, float32
// [out_features].
inline FloatSizes float_matmul(const char* op, const Tensor& x, const Tensor& packed,
                               const std::optional<Tensor>& bias, int64_t out_features) {
    const auto shape = x.sym_sizes();
    if (shape.size() != 2 || x.scalar_type() != ScalarType::Float) {
        bad(op, "x", "float32 [rows, in]", x);
    }
    const auto w = packed.sym_sizes();
    if (w.size() != 3 || w[2] != COLS || packed.scalar_type() != ScalarType::Float ||
        !packed.is_contiguous()) {
        bad(op, "packed", "a contiguous float32 [n16, in, 16]", packed);
    }
    const SymInt& n16 = w[0];
    if (out_features <= (n16 - 1) * COLS || out_features > n16 * COLS) {
        fail(op, "out_features ", out_features, " does not fill the packed weight's ", n16,
             " panels of 16 output features");
    }
    if (shape[1] != w[1]) {
        bad(op, "x", c10::str("[rows, ", w[1], "] (the packed weight's input columns)"), x);
    }
    if (bias.has_value() &&
        (!bias->sym_sizes().equals({SymInt(out_features)}) || bias->scalar_type() != ScalarType::Float)) {
        bad(op, "bias", c10::str("float32 [", out_features, "]"), *bias);
    }
    return {shape[0], shape[1]};
}

}  // namespace cadence_ops::float_checks
