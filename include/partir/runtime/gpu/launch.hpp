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

namespace partir::gpu {

inline constexpr int max_rank = 8;

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

// Index arithmetic shared by the kernels and the host-side tests (which check it without a GPU).
#ifdef __CUDACC__
#define PARTIR_HOST_DEVICE __host__ __device__
#else
#define PARTIR_HOST_DEVICE
#endif

// Element i (row-major over s.shape): its offsets in the source and the destination.
PARTIR_HOST_DEVICE inline void view_offsets(const StridedShape& s, std::int64_t i, std::int64_t& from, std::int64_t& to) {
  from = 0;
  to = 0;
  for (int d = s.rank - 1; d >= 0; --d) {
    const std::int64_t index = i % s.shape[d];
    i /= s.shape[d];
    from += index * s.src[d];
    to += index * s.dst[d];
  }
}

// Output element o: the offset of its first input element; reduced element j: its offset from there.
PARTIR_HOST_DEVICE inline std::int64_t kept_offset(const ReduceShape& s, std::int64_t o) {
  std::int64_t at = 0;
  for (int d = s.kept_rank - 1; d >= 0; --d) {
    at += (o % s.kept[d]) * s.kept_stride[d];
    o /= s.kept[d];
  }
  return at;
}
PARTIR_HOST_DEVICE inline std::int64_t reduced_offset(const ReduceShape& s, std::int64_t j) {
  std::int64_t at = 0;
  for (int d = s.reduced_rank - 1; d >= 0; --d) {
    at += (j % s.reduced[d]) * s.reduced_stride[d];
    j /= s.reduced[d];
  }
  return at;
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
// Sum or max over the reduced dims (empty reductions give 0 or the lowest value).
void reduce(bool take_max, DType t, const ReduceShape& s, const void* x, void* out, cudaStream_t stream);
// out[i, :] = table[indices[i] - first_row, :] for the `n` indices; rows outside [0, rows) give zeros, and
// when `sharded` is false they also set *bad_index (a device flag the executor reads after the run).
void gather(DType t, const void* table, const std::int32_t* indices, void* out, std::int64_t n, std::int64_t rows,
            std::int64_t row_elements, std::int64_t first_row, bool sharded, int* bad_index, cudaStream_t stream);
// out[indices[i] - first_row, :] += updates[i, :] (out must be zeroed first); rows outside are skipped as
// in gather. Float sums arrive in no fixed order (atomics): results can differ in the last bits run to run.
void scatter_add(DType t, const std::int32_t* indices, const void* updates, void* out, std::int64_t n, std::int64_t rows,
                 std::int64_t row_elements, std::int64_t first_row, bool sharded, int* bad_index, cudaStream_t stream);

}  // namespace launch
}  // namespace partir::gpu
