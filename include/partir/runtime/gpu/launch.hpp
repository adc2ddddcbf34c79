#pragma once
// The CUDA kernels' host-side entry points: plain functions on device pointers, declared here for the host
// compiler and defined in kernels.cuh, which a program compiles with nvcc in exactly one .cu file
// (partir's own build: cuda/kernels.cu). The split keeps nvcc away from the rest of partir (Eigen, C++20
// everywhere) and keeps nvcc's compile time to one small translation unit.
// Every launch is asynchronous on `stream`; element counts and strides are in elements.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "partir/ir/dtype.hpp"
#include "partir/ir/op.hpp"
#include "partir/runtime/kernels/window.hpp"

namespace partir::gpu {

inline constexpr int max_rank = 8;
using kernels::WindowShape;

// A strided view: element i (row-major over shape) is at sum(index[d] * stride[d]).
struct StridedShape {
  int rank = 0;
  std::int64_t shape[max_rank] = {};
  std::int64_t src[max_rank] = {};  // strides of the source
  std::int64_t dst[max_rank] = {};  // strides of the destination
};

// One reduction: every output element (row-major over `kept`) combines the input elements over `reduced`.
struct ReduceShape {
  int kept_rank = 0, reduced_rank = 0;
  std::int64_t kept[max_rank] = {}, kept_stride[max_rank] = {};
  std::int64_t reduced[max_rank] = {}, reduced_stride[max_rank] = {};
  std::int64_t outputs = 1, count = 1;  // products of kept and reduced
};

// Index arithmetic shared by the kernels and the host-side tests (which check it without a GPU);
// PARTIR_HOST_DEVICE comes from window.hpp.

// Element i (row-major over s.shape): its offsets in the source and the destination.
PARTIR_HOST_DEVICE inline void view_offsets(const StridedShape& s, std::int64_t i, std::int64_t& from, std::int64_t& to) {
  from = 0;
  to = 0;
  for (int d = s.rank - 1; d > 0; --d) {
    const std::int64_t index = i % s.shape[d];
    i /= s.shape[d];
    from += index * s.src[d];
    to += index * s.dst[d];
  }
  if (s.rank > 0) {  // i < the product of the shape, so what is left is the outermost index (no division)
    from += i * s.src[0];
    to += i * s.dst[0];
  }
}

// Output element o: the offset of its first input element; reduced element j: its offset from there.
PARTIR_HOST_DEVICE inline std::int64_t kept_offset(const ReduceShape& s, std::int64_t o) {
  std::int64_t at = 0;
  for (int d = s.kept_rank - 1; d > 0; --d) {
    at += (o % s.kept[d]) * s.kept_stride[d];
    o /= s.kept[d];
  }
  return s.kept_rank > 0 ? at + o * s.kept_stride[0] : at;  // o < s.outputs: what is left indexes dim 0
}
PARTIR_HOST_DEVICE inline std::int64_t reduced_offset(const ReduceShape& s, std::int64_t j) {
  std::int64_t at = 0;
  for (int d = s.reduced_rank - 1; d > 0; --d) {
    at += (j % s.reduced[d]) * s.reduced_stride[d];
    j /= s.reduced[d];
  }
  return s.reduced_rank > 0 ? at + j * s.reduced_stride[0] : at;  // j < s.count: what is left indexes dim 0
}

// Element k of a gather's result (or of a scatter-add's updates) over rows of `row` elements, one thread
// per element (per index when rows have no elements): the offset of its element in this table, which holds
// rows [first_row, first_row + rows) of `global_rows`, or -1 when another shard holds the row or rows are
// empty. An index outside [0, global_rows) sets *bad, sharded or not: the CPU path (executor.hpp,
// row_sharded) checks every index against the global row count and fails, so the GPU path must fail too.
PARTIR_HOST_DEVICE inline std::int64_t table_offset(const std::int32_t* indices, std::int64_t k, std::int64_t row,
                                                    std::int64_t rows, std::int64_t first_row,
                                                    std::int64_t global_rows, int* bad) {
  const std::int64_t per = row > 0 ? row : 1;
  const std::int64_t index = indices[k / per], e = k % per;
  if (e == 0 && (index < 0 || index >= global_rows)) *bad = 1;
  const std::int64_t r = index - first_row;
  return row > 0 && r >= 0 && r < rows ? r * row + e : -1;
}

// A reduction to few outputs over many elements would leave most of the GPU idle with one block per output
// (a loss summed over a whole batch runs on one SM), so each output's elements are split into `parts`
// chunks: a first pass reduces every chunk into scratch (outputs x parts, row-major), a second pass
// combines each output's chunks. Chunks and their order are fixed, so a result still depends on the data
// only. 1: one pass.
inline std::int64_t reduce_parts(const ReduceShape& s) {
  if (s.outputs == 0 || s.outputs >= 512 || s.count < 16384) return 1;
  const std::int64_t by_size = (s.count + 4095) / 4096, by_grid = (1024 + s.outputs - 1) / s.outputs;
  const std::int64_t parts = by_size < by_grid ? by_size : by_grid;
  return parts < 1 ? 1 : parts > 1024 ? 1024 : parts;
}

// Block b of a pass over `parts` chunks per output: its output o and its elements [first, last) of o's.
PARTIR_HOST_DEVICE inline void reduce_chunk(const ReduceShape& s, std::int64_t parts, std::int64_t b, std::int64_t& o,
                                            std::int64_t& first, std::int64_t& last) {
  const std::int64_t chunk = (s.count + parts - 1) / parts;
  o = b / parts;
  first = b % parts * chunk;
  last = first + chunk < s.count ? first + chunk : s.count;
}

// The second pass: `outputs` rows of `parts` partials each, summed or maxed along the rows.
inline ReduceShape partials_shape(std::int64_t outputs, std::int64_t parts) {
  ReduceShape s;
  s.kept_rank = s.reduced_rank = 1;
  s.kept[0] = outputs;
  s.kept_stride[0] = parts;
  s.reduced[0] = parts;
  s.reduced_stride[0] = 1;
  s.outputs = outputs;
  s.count = parts;
  return s;
}

namespace launch {

// out[i] = op(x[i]) for the unary kinds (f32, f64).
void unary(OpKind kind, DType t, const void* x, void* out, std::int64_t n, cudaStream_t stream);
// out[i] = op(x[i], y[i]) for add, sub, mul, div, max, min, pow (f32, f64).
void binary(OpKind kind, DType t, const void* x, const void* y, void* out, std::int64_t n, cudaStream_t stream);
// out[i] = (x[i] dir y[i]) ? 1 : 0 in t.
void compare(CompareDir dir, DType t, const void* x, const void* y, void* out, std::int64_t n, cudaStream_t stream);
// out[i] = mask[i] != 0 ? on_true[i] : on_false[i].
void select(DType mask, DType t, const void* m, const void* on_true, const void* on_false, void* out, std::int64_t n,
            cudaStream_t stream);
// out[i] = To(x[i]); float to i32 truncates toward zero.
void convert(DType from, DType to, const void* x, void* out, std::int64_t n, cudaStream_t stream);
// out[i] = value.
void fill(DType t, double value, void* out, std::int64_t n, cudaStream_t stream);
// dst view = src view, elements of `element_bytes` (4 or 8): transpose, broadcast (stride 0), slice, pad,
// concatenate, and the tile moves of collectives.
void strided_copy(int element_bytes, const StridedShape& s, const void* src, void* dst, cudaStream_t stream);
// Sum or max over the reduced dims (empty reductions give 0 or the lowest value). `scratch` holds
// s.outputs * reduce_parts(s) elements of t when reduce_parts(s) > 1 (else it may be null; a null scratch
// makes it one pass).
void reduce(bool take_max, DType t, const ReduceShape& s, const void* x, void* out, void* scratch, cudaStream_t stream);
// out[i, :] = table[indices[i] - first_row, :] for the `n` indices, where this table holds rows
// [first_row, first_row + rows) of a table of `global_rows` rows (unsharded: first_row 0, global_rows ==
// rows). Rows this table does not hold give zeros; an index outside [0, global_rows) also sets *bad_index
// (a device flag the executor reads after the run), as the CPU kernels check every index against the
// global row count. Indices are checked even when rows have no elements.
void gather(DType t, const void* table, const std::int32_t* indices, void* out, std::int64_t n, std::int64_t rows,
            std::int64_t row_elements, std::int64_t first_row, std::int64_t global_rows, int* bad_index,
            cudaStream_t stream);
// out[indices[i] - first_row, :] += updates[i, :] (out must be zeroed first); rows outside are skipped and
// indices checked as in gather. Float sums arrive in no fixed order (atomics): results can differ in the
// last bits run to run.
void scatter_add(DType t, const std::int32_t* indices, const void* updates, void* out, std::int64_t n, std::int64_t rows,
                 std::int64_t row_elements, std::int64_t first_row, std::int64_t global_rows, int* bad_index,
                 cudaStream_t stream);

// Convolution (no cuDNN here: a direct kernel, one thread per output element, sums in math precision):
// out [N, s.out..., O] = x [N, s.in..., C] convolved with w [s.window..., C / groups, O] (ConvDims in op.hpp).
void convolution(DType t, const WindowShape& s, std::int64_t images, std::int64_t in_features, std::int64_t out_features,
                 std::int64_t groups, const void* x, const void* w, void* out, cudaStream_t stream);
// reduce_window_sum / _max: out (row-major over s.out) = each window's sum or max over x (none inside: 0 or -inf).
void reduce_window(bool take_max, DType t, const WindowShape& s, const void* x, void* out, cudaStream_t stream);
// select_and_scatter: out (over s.in, zeroed first) += g[p] at the first maximum of x in window p (a window of
// padding only adds nowhere). Atomics, as scatter_add: where windows overlap, sums arrive in no fixed order.
void select_and_scatter(DType t, const WindowShape& s, const void* x, const void* g, void* out, cudaStream_t stream);

}  // namespace launch
}  // namespace partir::gpu
