#pragma once
// dot_general on cuBLAS: one cublasGemmStridedBatchedEx call. The operand layouts come from the CPU
// kernel's planner (kernels::plan_dot: which dims form each matrix, row- or column-major, outer stride);
// cuBLAS also needs all batch dims to advance by one stride, so an operand whose batch dims do not fuse,
// or whose matrix does not map in place, is first copied into [batch..., rows..., cols...] on the device.
// plan_gemm() is host code: the host-side tests run its plans through a reference of cuBLAS's semantics.
#include <cublas_v2.h>

#include <climits>
#include <cstdlib>

#include "partir/runtime/gpu/device_pool.hpp"
#include "partir/runtime/gpu/views.hpp"
#include "partir/runtime/kernels/dot_plan.hpp"

namespace partir::gpu {

inline void check_cublas(cublasStatus_t s, const char* call) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw UserError(std::string("cublas: ") + call + " failed: " + cublasGetStatusString(s) + " (status " +
                  std::to_string(static_cast<int>(s)) + ")");
}

// What cuBLAS needs of one operand: matrix order, leading dimension, batch stride, and whether it is first
// copied into [batch..., rows..., cols...] (row-major; `copy` says how).
struct GemmOperand {
  bool copied = false;
  View copy;
  bool row_major = true;
  std::int64_t ld = 1, batch_stride = 0;
};

// Batch dims that advance by one common stride (ignoring size-1 dims): that stride, else -1.
inline std::int64_t fused_batch_stride(const Shape& batch, const Strides& strides) {
  std::int64_t stride = 0, expect = -1;
  for (std::size_t i = batch.size(); i-- > 0;) {
    if (batch[i] == 1) continue;
    if (expect >= 0 && strides[i] != expect) return -1;
    if (expect < 0) stride = strides[i];
    expect = strides[i] * batch[i];
  }
  return stride;
}

inline GemmOperand gemm_operand(const Shape& shape, const kernels::OperandPlan& plan) {
  Shape batch;
  for (auto d : plan.batch) batch.push_back(shape[static_cast<std::size_t>(d)]);
  GemmOperand g;
  const std::int64_t stride = plan.transpose ? -1 : fused_batch_stride(batch, plan.batch_strides);
  if (stride >= 0) {
    g.row_major = plan.matrix.row_major;
    g.ld = plan.matrix.outer_stride;
    g.batch_stride = stride;
    return g;
  }
  const Strides xs = kernels::row_major_strides(shape);
  g.copied = true;
  for (const auto* group : {&plan.batch, &plan.rows, &plan.cols})
    for (auto d : *group) {
      g.copy.shape.push_back(shape[static_cast<std::size_t>(d)]);
      g.copy.src.push_back(xs[static_cast<std::size_t>(d)]);
    }
  g.copy.dst = kernels::row_major_strides(g.copy.shape);
  g.row_major = true;
  g.ld = std::max<std::int64_t>(plan.matrix.cols, 1);
  g.batch_stride = plan.matrix.rows * plan.matrix.cols;
  return g;
}

// The arguments of the one cublasGemmStridedBatchedEx call, in cuBLAS's column-major terms: the row-major
// result C = A B is computed as C^T = B^T A^T, so cuBLAS's first operand is the rhs (b) and its second the
// lhs (a). A row-major operand is, read column-major, its own transpose with the same ld, so it enters
// untransposed; a column-major one enters transposed.
struct GemmPlan {
  std::int64_t m = 0, n = 0, k = 0, batch = 1;  // row-major sizes: [batch, m, k] x [batch, k, n]
  GemmOperand a, b;                              // lhs, rhs
  bool transpose_first() const { return !b.row_major; }   // cuBLAS transa (applies to the rhs)
  bool transpose_second() const { return !a.row_major; }  // cuBLAS transb (applies to the lhs)
  std::int64_t ldc() const { return n; }
  std::int64_t stride_c() const { return m * n; }
};

inline GemmPlan plan_gemm(const Shape& lhs, const Shape& rhs, const DotDims& dims) {
  const kernels::DotPlan plan = kernels::plan_dot(lhs, rhs, dims);
  GemmPlan g;
  g.m = plan.lhs.matrix.rows;
  g.k = plan.lhs.matrix.cols;
  g.n = plan.rhs.matrix.cols;
  for (auto d : dims.lhs_batch) g.batch *= lhs[static_cast<std::size_t>(d)];
  g.a = gemm_operand(lhs, plan.lhs);
  g.b = gemm_operand(rhs, plan.rhs);
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

// out (row-major [batch..., lhs free..., rhs free...]) = dot_general(lhs, rhs).
inline void dot_general(cublasHandle_t blas, const Shape& lhs_shape, const void* lhs, const Shape& rhs_shape,
                        const void* rhs, const DotDims& dims, DType t, void* out, DevicePool& pool, cudaStream_t stream) {
  if (t == DType::i32) user_error("dot_general: i32 operands are not supported, convert them to a float type first");
  const GemmPlan g = plan_gemm(lhs_shape, rhs_shape, dims);
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  if (g.k == 0) {
    check_cuda(cudaMemsetAsync(out, 0, static_cast<std::size_t>(g.batch * g.m * g.n * size_of(t)), stream), "cudaMemsetAsync");
    return;
  }
  for (auto [what, v] : {std::pair{"rows", g.m}, {"contracted size", g.k}, {"cols", g.n}, {"batch", g.batch},
                         {"lhs leading dimension", g.a.ld}, {"rhs leading dimension", g.b.ld}})
    if (v > INT_MAX)
      user_error(std::string("dot_general on cuBLAS: ") + what + " " + std::to_string(v) + " exceeds int range");
  // Operands that need a copy go through pool blocks, given back once the call is enqueued (stream order).
  auto prepare = [&](const GemmOperand& o, const Shape& shape, const void* data, void*& scratch) {
    if (!o.copied) return data;
    scratch = pool.take(num_elements(shape) * size_of(t));
    copy(o.copy, data, scratch, t, stream);
    return static_cast<const void*>(scratch);
  };
  void *a_scratch = nullptr, *b_scratch = nullptr;
  const void* a = prepare(g.a, lhs_shape, lhs, a_scratch);
  const void* b = prepare(g.b, rhs_shape, rhs, b_scratch);
  check_cublas(cublasSetStream(blas, stream), "cublasSetStream");
  // 16-bit operands multiply on tensor cores and accumulate in f32 (alpha and beta are then f32 too), as
  // the CPU's bf16/f16 GEMMs do; the result is rounded to 16 bits once.
  const float one_f = 1, zero_f = 0;
  const double one_d = 1, zero_d = 0;
  const bool f64 = t == DType::f64;
  const cudaDataType_t type = t == DType::bf16 ? CUDA_R_16BF : t == DType::f16 ? CUDA_R_16F : f64 ? CUDA_R_64F : CUDA_R_32F;
  const cublasComputeType_t compute = f64                                 ? CUBLAS_COMPUTE_64F
                                      : t == DType::f32 && tf32_allowed() ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                          : CUBLAS_COMPUTE_32F;
  auto op = [](bool transpose) { return transpose ? CUBLAS_OP_T : CUBLAS_OP_N; };
  check_cublas(cublasGemmStridedBatchedEx(blas, op(g.transpose_first()), op(g.transpose_second()), static_cast<int>(g.n),
                                          static_cast<int>(g.m), static_cast<int>(g.k),
                                          f64 ? static_cast<const void*>(&one_d) : &one_f, b, type, static_cast<int>(g.b.ld),
                                          g.b.batch_stride, a, type, static_cast<int>(g.a.ld), g.a.batch_stride,
                                          f64 ? static_cast<const void*>(&zero_d) : &zero_f, out, type,
                                          static_cast<int>(g.ldc()), g.stride_c(), static_cast<int>(g.batch), compute,
                                          CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx");
  const std::int64_t lhs_bytes = num_elements(lhs_shape) * size_of(t), rhs_bytes = num_elements(rhs_shape) * size_of(t);
  pool.give(a_scratch, lhs_bytes);
  pool.give(b_scratch, rhs_bytes);
}

}  // namespace partir::gpu
