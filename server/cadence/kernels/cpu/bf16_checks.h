// What bf16_matmul_tiles (cpu_ops.cpp) requires of its arguments, checked by the CPU and the
// Meta implementation alike (cpu_ops_checks.h's conventions: a ValueError naming the
// argument). The packed weight's layout is bf16_kernels.cpp's; its sizes must agree with the
// input's width and the output features, since the kernel walks it through raw pointers.

#pragma once

#include "cpu_ops_checks.h"

namespace cadence_ops::bf16_checks {

using at::Tensor;
using c10::ScalarType;
using c10::SymInt;
using checks::bad;
using checks::fail;

constexpr int64_t COLS = 16, K_STEP = 32;  // bf16_kernels.cpp's tile: 16 channels x 32 inputs

struct Bf16Sizes {
    SymInt rows, in;
};

// x [rows, in] bfloat16 (any strides: the operator packs its rows); packed bfloat16 [n16,
// k32, 16, 32], contiguous, in within its last input block and out_features within its
// last channel block; bias, when given, bfloat16 [out_features].
inline Bf16Sizes bf16_matmul(const char* op, const Tensor& x, const Tensor& packed,
                             const std::optional<Tensor>& bias, int64_t out_features) {
    const auto shape = x.sym_sizes();
    if (shape.size() != 2 || x.scalar_type() != ScalarType::BFloat16) {
        bad(op, "x", "bfloat16 [rows, in]", x);
    }
    const auto w = packed.sym_sizes();
    if (w.size() != 4 || w[2] != COLS || w[3] != K_STEP ||
        packed.scalar_type() != ScalarType::BFloat16 || !packed.is_contiguous()) {
        bad(op, "packed", "a contiguous bfloat16 [n16, k32, 16, 32]", packed);
    }
    const SymInt &n16 = w[0], &k32 = w[1];
    if (out_features <= (n16 - 1) * COLS || out_features > n16 * COLS) {
        fail(op, "out_features ", out_features, " does not fill the packed weight's ", n16,
             " blocks of 16 output features");
    }
    if (shape[1] <= (k32 - 1) * K_STEP || shape[1] > k32 * K_STEP) {
        bad(op, "x", c10::str("[rows, in] with in in the packed weight's ", k32,
                              " blocks of 32 input columns"), x);
    }
    if (bias.has_value() && (!bias->sym_sizes().equals({SymInt(out_features)}) ||
                             bias->scalar_type() != ScalarType::BFloat16)) {
        bad(op, "bias", c10::str("bfloat16 [", out_features, "]"), *bias);
    }
    return {shape[0], shape[1]};
}

}  // namespace cadence_ops::bf16_checks
