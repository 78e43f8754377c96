// What the LoRA operators of cpu_ops.cpp (lora_shrink_rows_, lora_expand_rows_) require of
// their arguments: shapes, dtypes and layouts, checked by the CPU and the Meta
// implementation alike (cpu_ops_checks.h's conventions: a ValueError naming the argument).
//
// Unlike the other operators' index tensors, the LoRA tables' values are scanned too, by
// the CPU implementation (the Meta one has none): each index is a row of the KV pool read
// as rows of one width, so one out of range would read outside the pool. A call reads a
// few hundred of them; an index out of range is an IndexError naming it.

#pragma once

#include "cpu_ops_checks.h"

#include <optional>

namespace cadence_ops::lora_checks {

using at::Tensor;
using c10::ScalarType;
using c10::SymInt;
using checks::bad;
using checks::dtype_name;
using checks::fail;

inline bool is_index_dtype(ScalarType t) { return t == ScalarType::Long || t == ScalarType::Int; }

// An int64 or int32 index tensor of `shape`.
inline void index(const char* op, const char* arg, const Tensor& t,
                  std::initializer_list<SymInt> shape) {
    if (!is_index_dtype(t.scalar_type()) || !t.sym_sizes().equals(shape)) {
        bad(op, arg, c10::str("int64 or int32 ", c10::ArrayRef<SymInt>(shape)), t);
    }
}

// A pool read as rows [N, width] of `dtype`, each row packed (rows of a flat view of the KV
// cache: never copied, so they must already be laid out as the kernel reads them).
inline void pool_rows(const char* op, const char* arg, const Tensor& t, const SymInt& width,
                      ScalarType dtype) {
    const auto shape = t.sym_sizes();
    if (shape.size() != 2 || shape[1] != width || t.scalar_type() != dtype ||
        (shape[0] > 1 && t.sym_strides()[1] != 1)) {
        bad(op, arg, c10::str(dtype_name(dtype), " [rows, ", width, "], each row packed"), t);
    }
}

// The rows a call covers among `tokens`: row_adapter [n] with rows [n] or, without rows,
// first_row .. first_row + n. -> n
inline SymInt selection(const char* op, const Tensor& row_adapter,
                        const std::optional<Tensor>& rows, int64_t first_row,
                        const SymInt& tokens) {
    const auto shape = row_adapter.sym_sizes();
    if (!is_index_dtype(row_adapter.scalar_type()) || shape.size() != 1) {
        bad(op, "row_adapter", "int64 or int32 [rows]", row_adapter);
    }
    const SymInt& n = shape[0];
    if (rows) {
        index(op, "rows", *rows, {n});
    } else if (first_row < 0 || first_row + n > tokens) {
        fail(op, "first_row ", first_row, " + ", n, " rows must lie within the ", tokens,
             " rows");
    }
    return n;
}

struct ShrinkSizes {
    SymInt tokens, in, rmax, adapters, n;
};

inline ShrinkSizes shrink(const char* op, const Tensor& x, const Tensor& rows_in,
                          const Tensor& a_idx, const Tensor& ranks, const Tensor& row_adapter,
                          const std::optional<Tensor>& rows, int64_t first_row,
                          const Tensor& h) {
    const auto shape = x.sym_sizes();
    const ScalarType dtype = x.scalar_type();
    if (shape.size() != 2 || !checks::is_kernel_dtype(dtype)) {
        bad(op, "x", "float32, bfloat16 or float16 [tokens, in]", x);
    }
    pool_rows(op, "rows_in", rows_in, shape[1], dtype);
    const auto table = a_idx.sym_sizes();
    if (!is_index_dtype(a_idx.scalar_type()) || table.size() != 2) {
        bad(op, "a_idx", "int64 or int32 [adapters, rmax]", a_idx);
    }
    index(op, "ranks", ranks, {table[0]});
    const SymInt n = selection(op, row_adapter, rows, first_row, shape[0]);
    checks::written<2>(op, "h", h, {shape[0], table[1]}, dtype);
    return {shape[0], shape[1], table[1], table[0], n};
}

struct ExpandSizes {
    SymInt tokens, out, rank_width, adapters, n;
};

inline ExpandSizes expand(const char* op, const Tensor& y, const Tensor& h,
                          const Tensor& rows_out, const Tensor& b_idx, const Tensor& piece_ranks,
                          const Tensor& rank_start, int64_t out_offset,
                          const Tensor& row_adapter, const std::optional<Tensor>& rows,
                          int64_t first_row) {
    const auto shape = y.sym_sizes();
    const ScalarType dtype = y.scalar_type();
    if (shape.size() != 2 || !checks::is_kernel_dtype(dtype) ||
        (shape[1] > 1 && y.sym_strides()[1] != 1)) {
        bad(op, "y", "float32, bfloat16 or float16 [tokens, out_total], each row packed", y);
    }
    const auto h_shape = h.sym_sizes();
    if (h_shape.size() != 2 || h_shape[0] != shape[0] || h.scalar_type() != dtype) {
        bad(op, "h", c10::str(dtype_name(dtype), " [", shape[0], ", rank]"), h);
    }
    const auto out_shape = rows_out.sym_sizes();
    if (out_shape.size() != 2) bad(op, "rows_out", "[rows, out]", rows_out);
    pool_rows(op, "rows_out", rows_out, out_shape[1], dtype);
    if (out_offset < 0 || out_offset + out_shape[1] > shape[1]) {
        fail(op, "out_offset ", out_offset, " + rows_out's ", out_shape[1],
             " columns must lie within y's ", shape[1]);
    }
    const auto table = b_idx.sym_sizes();
    if (!is_index_dtype(b_idx.scalar_type()) || table.size() != 2) {
        bad(op, "b_idx", "int64 or int32 [adapters, rmax]", b_idx);
    }
    index(op, "piece_ranks", piece_ranks, {table[0]});
    index(op, "rank_start", rank_start, {table[0]});
    const SymInt n = selection(op, row_adapter, rows, first_row, shape[0]);
    return {shape[0], out_shape[1], h_shape[1], table[0], n};
}

// ---- values (the CPU implementation, over packed int64 copies) ---------------------------

[[noreturn]] inline void out_of_range(const char* op, const std::string& what, int64_t value,
                                      const std::string& allowed) {
    C10_THROW_ERROR(IndexError,
                    c10::str("cadence::", op, ": ", what, " = ", value, " is out of range: ",
                             allowed));
}

// Each row of the selection is one of the `tokens` rows and names an adapter or -1.
inline void selection_values(const char* op, const int64_t* row_adapter, const int64_t* rows,
                             int64_t n, int64_t tokens, int64_t adapters) {
    for (int64_t i = 0; i < n; ++i) {
        if (row_adapter[i] < -1 || row_adapter[i] >= adapters) {
            out_of_range(op, c10::str("row_adapter[", i, "]"), row_adapter[i],
                         c10::str("an adapter in [0, ", adapters, ") or -1"));
        }
        if (rows && (rows[i] < 0 || rows[i] >= tokens)) {
            out_of_range(op, c10::str("rows[", i, "]"), rows[i],
                         c10::str("a row in [0, ", tokens, ")"));
        }
    }
}

// Per adapter, rank (its ranks entry) within [0, width] and its first `rank` indices
// (what a row of it reads) rows of a pool of `pool` rows.
inline void table_values(const char* op, const char* table, const char* ranks_name,
                         const int64_t* idx, const int64_t* ranks, int64_t adapters,
                         int64_t width, int64_t pool, const char* pool_name) {
    for (int64_t a = 0; a < adapters; ++a) {
        if (ranks[a] < 0 || ranks[a] > width) {
            out_of_range(op, c10::str(ranks_name, "[", a, "]"), ranks[a],
                         c10::str("a rank in [0, ", width, "] (", table, "'s columns)"));
        }
        for (int64_t j = 0; j < ranks[a]; ++j) {
            const int64_t row = idx[a * width + j];
            if (row < 0 || row >= pool) {
                out_of_range(op, c10::str(table, "[", a, ", ", j, "]"), row,
                             c10::str("a row of ", pool_name, " in [0, ", pool, ")"));
            }
        }
    }
}

// Per adapter, the h columns its piece reads: rank_start[a] + piece_ranks[a] <= width.
inline void rank_start_values(const char* op, const int64_t* rank_start,
                              const int64_t* piece_ranks, int64_t adapters, int64_t width) {
    for (int64_t a = 0; a < adapters; ++a) {
        if (rank_start[a] < 0 || rank_start[a] + piece_ranks[a] > width) {
            out_of_range(op, c10::str("rank_start[", a, "]"), rank_start[a],
                         c10::str("h's columns rank_start .. rank_start + piece_ranks[", a,
                                  "] (", piece_ranks[a], ") must lie within its ", width));
        }
    }
}

}  // namespace cadence_ops::lora_checks
