#pragma once
// dot_general on cuBLAS: one cublasGemmStridedBatchedEx call. The operand layouts come from the CPU
// kernel's planner (kernels::plan_dot: which dims form each matrix, row- or column-major, outer stride);
// cuBLAS also needs all batch dims to advance by one stride, so an operand whose batch dims do not fuse,
// or whose matrix does not map in place, is first copied into [batch..., rows..., cols...] on the device.
#include <cublas_v2.h>

#include <climits>
#include <cstdlib>

#include "partir/runtime/gpu/device_pool.hpp"
#include "partir/runtime/gpu/launch.hpp"
#include "partir/runtime/kernels.hpp"

namespace partir::gpu {

inline void check_cublas(cublasStatus_t s, const char* call) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw UserError(std::string("cublas: ") + call + " failed: " + cublasGetStatusString(s) + " (status " +
                  std::to_string(static_cast<int>(s)) + ")");
}

// dst = src viewed through (shape, src strides) into (shape, dst strides), after fusing contiguous dims.
inline void copy_view(Shape shape, kernels::Strides src_strides, kernels::Strides dst_strides, const void* src, void* dst,
                      DType t, cudaStream_t stream) {
  if (num_elements(shape) == 0) return;
  std::array<kernels::Strides, 2> strides{std::move(src_strides), std::move(dst_strides)};
  kernels::simplify(shape, strides);
  StridedShape s;
  s.rank = static_cast<int>(shape.size());
  if (s.rank > max_rank)
    user_error("gpu: a copy over " + std::to_string(s.rank) + " non-contiguous dims exceeds the kernels' limit of " +
               std::to_string(max_rank));
  for (int d = 0; d < s.rank; ++d) {
    s.shape[d] = shape[static_cast<std::size_t>(d)];
    s.src[d] = strides[0][static_cast<std::size_t>(d)];
    s.dst[d] = strides[1][static_cast<std::size_t>(d)];
  }
  launch::strided_copy(static_cast<int>(size_of(t)), s, src, dst, stream);
}

// What cuBLAS needs of one operand: pointer, matrix order, leading dimension, batch stride.
struct GemmOperand {
  const void* data = nullptr;
  bool row_major = true;
  std::int64_t ld = 1, batch_stride = 0;
  void* scratch = nullptr;  // a pool block holding a transposed copy, given back after the call
  std::int64_t scratch_bytes = 0;
};

// Batch dims that advance by one common stride (ignoring size-1 dims): that stride, else -1.
inline std::int64_t fused_batch_stride(const Shape& batch, const kernels::Strides& strides) {
  std::int64_t stride = 0, expect = -1;
  for (std::size_t i = batch.size(); i-- > 0;) {
    if (batch[i] == 1) continue;
    if (expect >= 0 && strides[i] != expect) return -1;
    if (expect < 0) stride = strides[i];
    expect = strides[i] * batch[i];
  }
  return stride;
}

inline GemmOperand gemm_operand(const Shape& shape, const void* data, kernels::OperandPlan plan, DType t,
                                DevicePool& pool, cudaStream_t stream) {
  Shape batch;
  for (auto d : plan.batch) batch.push_back(shape[static_cast<std::size_t>(d)]);
  GemmOperand g;
  std::int64_t stride = plan.transpose ? -1 : fused_batch_stride(batch, plan.batch_strides);
  if (stride < 0) {  // copy into [batch..., rows..., cols...], row-major
    const kernels::Strides xs = kernels::row_major_strides(shape);
    Shape copy_shape;
    kernels::Strides src;
    for (const auto* group : {&plan.batch, &plan.rows, &plan.cols})
      for (auto d : *group) {
        copy_shape.push_back(shape[static_cast<std::size_t>(d)]);
        src.push_back(xs[static_cast<std::size_t>(d)]);
      }
    g.scratch_bytes = num_elements(shape) * size_of(t);
    g.scratch = pool.take(g.scratch_bytes);
    copy_view(copy_shape, src, kernels::row_major_strides(copy_shape), data, g.scratch, t, stream);
    g.data = g.scratch;
    g.row_major = true;
    g.ld = std::max<std::int64_t>(plan.matrix.cols, 1);
    g.batch_stride = plan.matrix.rows * plan.matrix.cols;
    return g;
  }
  g.data = data;
  g.row_major = plan.matrix.row_major;
  g.ld = plan.matrix.outer_stride;
  g.batch_stride = stride;
  return g;
}

// fp32 products use exact fp32 arithmetic (as the CPU kernels) unless PARTIR_CUBLAS_TF32=1 allows tensor
// cores' TF32 inputs (about 8x the H200's fp32 rate, with 10-bit mantissas).
inline bool tf32_allowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("PARTIR_CUBLAS_TF32");
    return v && std::string(v) == "1";
  }();
  return allowed;
}

// out (row-major [batch..., lhs free..., rhs free...]) = dot_general(lhs, rhs). Row-major C = A B is
// computed as column-major C^T = B^T A^T: cuBLAS sees the row-major result as its transpose with ld = N.
inline void dot_general(cublasHandle_t blas, const Shape& lhs_shape, const void* lhs, const Shape& rhs_shape,
                        const void* rhs, const DotDims& dims, DType t, void* out, DevicePool& pool, cudaStream_t stream) {
  if (t != DType::f32 && t != DType::f64)
    user_error("dot_general: i32 operands are not supported, convert them to f32 or f64 first");
  const kernels::DotPlan plan = kernels::plan_dot(lhs_shape, rhs_shape, dims);
  const std::int64_t m = plan.lhs.matrix.rows, k = plan.lhs.matrix.cols, n = plan.rhs.matrix.cols;
  std::int64_t batch = 1;
  for (auto d : dims.lhs_batch) batch *= lhs_shape[static_cast<std::size_t>(d)];
  if (m == 0 || n == 0 || batch == 0) return;
  if (k == 0) {
    check_cuda(cudaMemsetAsync(out, 0, static_cast<std::size_t>(batch * m * n * size_of(t)), stream), "cudaMemsetAsync");
    return;
  }
  for (auto [what, v] : {std::pair{"rows", m}, {"contracted size", k}, {"cols", n}, {"batch", batch}})
    if (v > INT_MAX)
      user_error(std::string("dot_general on cuBLAS: ") + what + " " + std::to_string(v) + " exceeds int range");
  GemmOperand a = gemm_operand(lhs_shape, lhs, plan.lhs, t, pool, stream);
  GemmOperand b = gemm_operand(rhs_shape, rhs, plan.rhs, t, pool, stream);
  // Column-major views: a row-major operand is its own transpose with the same ld, so it enters C^T = B^T A^T
  // untransposed (N); a column-major one enters transposed (T).
  const cublasOperation_t op_b = b.row_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t op_a = a.row_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  check_cublas(cublasSetStream(blas, stream), "cublasSetStream");
  const float one_f = 1, zero_f = 0;
  const double one_d = 1, zero_d = 0;
  const bool f32 = t == DType::f32;
  const cudaDataType_t type = f32 ? CUDA_R_32F : CUDA_R_64F;
  const cublasComputeType_t compute =
      f32 ? (tf32_allowed() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F) : CUBLAS_COMPUTE_64F;
  check_cublas(cublasGemmStridedBatchedEx(blas, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                                          f32 ? static_cast<const void*>(&one_f) : &one_d, b.data, type,
                                          static_cast<int>(b.ld), b.batch_stride, a.data, type, static_cast<int>(a.ld),
                                          a.batch_stride, f32 ? static_cast<const void*>(&zero_f) : &zero_d, out, type,
                                          static_cast<int>(n), m * n, static_cast<int>(batch), compute,
                                          CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx");
  pool.give(a.scratch, a.scratch_bytes);
  pool.give(b.scratch, b.scratch_bytes);
}

}  // namespace partir::gpu
