// The C entry points of the kernel library, declared once for both sides of the call: the
// kernels' definitions (a definition that differs from its declaration here is a compile
// error, both being extern "C") and the operator shim cpu_ops.cpp, which takes its
// function-pointer types from them. Plain C ABI, no torch: one library per instruction
// set, each dlopen'ed by the shim.
//
// The library is one translation unit per op family, compiled together with g++ -O3
// -fopenmp once per instruction set (cadence/kernels/cpu/builds.py, cadence/cpu_isa.py):
// attention_kernels.cpp (paged decode attention), rotary_kernels.cpp (the rotary, and with
// it the KV-cache write), elementwise_kernels.cpp (RMSNorm, SwiGLU), sampling_kernels.cpp
// (greedy with log-probabilities), lora_kernels.cpp, quant_kernels.cpp and
// float_kernels.cpp (float32 products on prepacked weights), bf16_kernels.cpp (bfloat16
// products on AMX-BF16 tiles). Their vector
// paths are chosen at compile time by what that build's -march enables
// (CADENCE_AVX512_BF16, CADENCE_AVX2, else portable: cpu_elements.h). Python calls them
// only through the torch operators of the shim (torch.ops.cadence.*), which checks every
// shape, dtype, device and layout (cpu_ops_checks.h) and calls the selected library's entry
// points through function pointers: each entry point takes raw pointers and trusts them.
// Everything here is memory-bound work that torch on CPU does in several passes. OpenMP
// is the same runtime torch uses (its bundled libgomp.so.1 is loaded first).

#pragma once

#include <cstdint>

namespace cadence_kernels {

// The element types an entry point takes, by code. The last three are the quantized KV
// cache's (cadence/kv_format.py): int8 with a float32 scale per (slot, KV head), and the
// two fp8 formats with one float32 scale per layer.
enum DType : int { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, F8E4M3 = 4, F8E5M2 = 5 };

// What an entry point returns (the shim names each in its error). The last four are
// cadence_quant_matmul_tiles': hardware AMX asked for without cadence_amx_request's grant;
// a library built without the AMX kernel (every build but avx512_bf16); a tiles argument
// not one of QuantTiles; an instruction the emulated tiles record as one the hardware
// refuses (a kernel bug).
enum Status : int {
    OK = 0,
    BAD_HEADS = 1,
    BAD_DTYPE = 2,
    NO_AMX = 3,
    NO_AMX_KERNEL = 4,
    BAD_TILES = 5,
    TILE_FAULT = 6,
};

// The quantized weight formats of cadence_quant_matmul: int4 per group, int8 per output
// channel, int8 per block of 32 input columns (GGUF's Q8_0).
enum QuantFormat : int { QUANT_INT4 = 0, QUANT_INT8 = 1, QUANT_INT8_BLOCKS = 2 };

// How cadence_quant_matmul_tiles computes its dot products: AMX's instructions, or their
// emulation (amx_tiles.h: what the instructions compute, on any CPU with AVX-512 VNNI).
enum QuantTiles : int { TILES_AMX = 1, TILES_EMULATED = 2 };

}  // namespace cadence_kernels

extern "C" {

// q, out: [num_seqs, num_heads, head_dim] of q_dtype; caches of kv_dtype: [num_blocks,
// block_size, num_kv_heads, head_dim]; block_tables: [num_seqs, table_stride] int64;
// context_lens: [num_seqs] int64 (keys visible to each query, itself included).
// window <= 0: no sliding window. k_scale/v_scale: an int8 cache's [num_blocks, block_size,
// num_kv_heads] scales, an fp8 cache's one layer scale, unused (may be null) for a float one.
int cadence_paged_decode_attention(const void* q, void* out, const void* k_cache,
                                   const void* v_cache, const float* k_scale,
                                   const float* v_scale, const int64_t* block_tables,
                                   int64_t table_stride, const int64_t* context_lens,
                                   int64_t num_seqs, int num_heads, int num_kv_heads,
                                   int head_dim, int block_size, float scale, int64_t window,
                                   int q_dtype, int kv_dtype, int num_threads);

// logits: [rows, vocab] of dtype (float32 or bfloat16) -> the argmax of each row and its
// log-probability.
int cadence_greedy_logprobs(const void* logits, int64_t rows, int64_t vocab, int64_t* ids,
                            float* logprobs, int dtype, int num_threads);

// out = RMSNorm(x + residual) and residual_out = x + residual when residual is given,
// else out = RMSNorm(x); all [rows, hidden] of dtype, weight [hidden].
int cadence_rms_norm(const void* x, const void* residual, const void* weight, void* out,
                     void* residual_out, int64_t rows, int64_t hidden, float eps, int dtype,
                     int num_threads);

// x: [rows, 2 * inter] (gate | up) -> out: [rows, inter], both of dtype.
int cadence_silu_mul(const void* x, void* out, int64_t rows, int64_t inter, int dtype,
                     int num_threads);

// x: [tokens, heads, head_dim] of dtype, rows x_stride apart, rotated in place;
// cos/sin: [tokens, head_dim] of dtype.
int cadence_rotary(void* x, int64_t tokens, int heads, int head_dim, int64_t x_stride,
                   const void* cos, const void* sin, int dtype, int num_threads);

// qkv: [tokens, x_stride] of dtype (q heads | k heads | v heads per row); cos/sin:
// [tokens, head_dim] of dtype; q_out: [tokens, heads, head_dim] of dtype; caches of
// kv_dtype [slots, kv_heads, head_dim]; slots: [tokens] int64; k_scale/v_scale as in
// cadence_paged_decode_attention (an int8 cache's are written, an fp8 cache's read).
int cadence_rotary_write_kv(const void* qkv, int64_t tokens, int64_t x_stride, int heads,
                            int kv_heads, int head_dim, const void* cos, const void* sin,
                            void* q_out, void* k_cache, void* v_cache, float* k_scale,
                            float* v_scale, const int64_t* slots, int dtype, int kv_dtype,
                            int num_threads);

// cadence_rotary_write_kv for num_seqs new tokens (one per sequence, q_out their rotated
// queries), then cadence_paged_decode_attention of q_out into out.
int cadence_decode_layer_attention(const void* qkv, int64_t x_stride, const void* cos,
                                   const void* sin, void* q_out, void* out, void* k_cache,
                                   void* v_cache, float* k_scale, float* v_scale,
                                   const int64_t* slots,
                                   const int64_t* block_tables, int64_t table_stride,
                                   const int64_t* context_lens, int64_t num_seqs, int num_heads,
                                   int num_kv_heads, int head_dim, int block_size, float scale,
                                   int64_t window, int dtype, int kv_dtype, int num_threads);

// The tiles an int8 KV cache's attention under bfloat16 or float16 queries runs on, from
// now on in this process: 0 the VNNI vector code; TILES_AMX (NO_AMX unless
// cadence_amx_request grants AMX) or TILES_EMULATED the AMX-INT8 kernel
// (attention_int8_amx.h, head_dim 64, 128 or 256; others keep the vector code) for the
// calls of at least min_rows query rows over one table (a prompt chunk's consecutive
// tokens; 1: every call), bitwise equal to the vector code. NO_AMX_KERNEL from the builds
// other than avx512_bf16's; BAD_TILES for min_rows < 1. *previous, *previous_min_rows:
// the setting before the call, whatever the status.
int cadence_attention_tiles(int tiles, int min_rows, int* previous, int* previous_min_rows);

// LoRA (lora_kernels.cpp) over n rows of a step: row i is rows[i], or first_row + i when
// rows is null; row_adapter[i] its adapter (-1: none). The pool's rows: rows_in [N, in],
// rows_out [N, out] of dtype, each row packed, row i starting rows_stride elements after
// row i - 1 (1 for the pool's view whose row i starts at element i). Index tables int64: a_idx [A, rmax] with
// ranks [A]; b_idx [A, b_stride] with piece_ranks [A] and rank_start [A]. Every index a
// row reads (an adapter's first rank ones) must be a row of the pool.
// h: [T, rmax] packed, row t written for each covered row t (0 past its rank).
int cadence_lora_shrink(const void* x, int64_t x_stride, const void* rows_in, int64_t in,
                        int64_t rows_stride, const int64_t* a_idx, int64_t rmax, const int64_t* ranks,
                        const int64_t* row_adapter, const int64_t* rows, int64_t first_row,
                        int64_t n, void* h, int dtype, int num_threads);

// y [T, y_stride] (columns out_offset .. out_offset + out added to), h [T, h_stride].
int cadence_lora_expand(void* y, int64_t y_stride, int64_t out_offset, const void* h,
                        int64_t h_stride, const void* rows_out, int64_t out,
                        int64_t rows_stride, const int64_t* b_idx, int64_t b_stride, const int64_t* piece_ranks,
                        const int64_t* rank_start, const int64_t* row_adapter,
                        const int64_t* rows, int64_t first_row, int64_t n, int dtype,
                        int num_threads);

// y [m, n] = x [m, k] @ W.T with W packed by cadence/quant/cpu_gemm.py (quant_kernels.cpp
// has the layouts: `packed` uint8, `scales` float32, per format), x and y of dtype (float32
// or bfloat16), rows x_stride / y_stride elements apart; x is quantized to int8 per row and
// block of 32 columns on the way in.
int cadence_quant_matmul(const void* x, int64_t x_stride, int64_t m, int64_t k,
                         const void* packed, const float* scales, int64_t n, int format,
                         void* y, int64_t y_stride, int dtype, int num_threads);

// y [m, n] = x [m, k] @ W.T, float32, with W packed by cadence/layers/packed.py into
// panels of 16 output columns: packed [ceil(n / 16), k, 16], element (p, i, c) = W[16 p + c,
// i] (zero past n), 32-byte aligned. Rows x_stride / y_stride elements apart. Each output is
// one FMA chain over k ascending from +0 in every build (float_kernels.cpp), so a row's
// result is the same bits whatever m, its place among the rows, or the threads.
int cadence_float_matmul(const float* x, int64_t x_stride, int64_t m, int64_t k,
                         const float* packed, int64_t n, float* y, int64_t y_stride,
                         int num_threads);

// 1 when this process may run AMX-INT8 (the CPU has AMX-TILE and AMX-INT8 and Linux granted
// the tile data state), else 0; asked once, the answer kept. 0 from every library but
// avx512_bf16's, which alone has the AMX kernel.
int cadence_amx_request(void);

// 1 when this process may run AMX-BF16 (the CPU has AMX-TILE and AMX-BF16 and Linux granted
// the tile data permission; asked once, the answer kept); 0 otherwise, and from every
// library but avx512_bf16's.
int cadence_amx_bf16_request(void);

// y[m, n] = x[m, k] @ W.T, bfloat16 in and out, on AMX-BF16 tiles (bf16_kernels.cpp): W
// packed [n16][k32][16][32] as AMX's B tiles; `tiles` TILES_AMX (NO_AMX unless
// cadence_amx_bf16_request granted it) or TILES_EMULATED. Each output one tdpbf16ps chain
// over k ascending: a row's bits do not depend on the call's other rows.
int cadence_bf16_matmul_tiles(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k,
                              const uint16_t* packed, int64_t n, uint16_t* y, int64_t y_stride,
                              int num_threads, int tiles);

// SwiGLU over a fused gate/up projection on the same tiles: W packed as above with 2 inter
// channels (gate, then up; inter a multiple of 16), y[m, inter] = silu_mul(x @ W.T) with
// the bits of cadence_bf16_matmul_tiles followed by cadence_silu_mul.
int cadence_bf16_matmul_tiles_swiglu(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k,
                                     const uint16_t* packed, int64_t inter, uint16_t* y,
                                     int64_t y_stride, int num_threads, int tiles);

// cadence_quant_matmul with AMX-INT8 tiles (quant_amx.h): `tiles` TILES_AMX (NO_AMX unless
// cadence_amx_request granted AMX in this process) or TILES_EMULATED. Bitwise equal to
// cadence_quant_matmul of the same library (avx512_bf16's; NO_AMX_KERNEL from the others).
int cadence_quant_matmul_tiles(const void* x, int64_t x_stride, int64_t m, int64_t k,
                               const void* packed, const float* scales, int64_t n, int format,
                               void* y, int64_t y_stride, int dtype, int num_threads,
                               int tiles);

}  // extern "C"
