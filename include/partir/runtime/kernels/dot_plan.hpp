#pragma once
// How dot_general maps onto GEMMs, shared by the CPU kernel (kernels.hpp) and cuBLAS (gpu/gemm.hpp).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "partir/ir/op.hpp"
#include "partir/runtime/kernels/strides.hpp"

namespace partir::kernels {

// dot_general as a loop of GEMMs. Per batch index each operand is a matrix over two groups of dims (lhs:
// free x contracting, rhs: contracting x free). Eigen maps it in place when one group is contiguous and
// the other advances by one stride (row- or column-major with an outer stride); batch dims may sit
// anywhere, as they only move the base pointer. An operand that fits neither way is first transposed
// into [batch..., group 0..., group 1...].
struct DimGroup {
  std::int64_t size = 1;
  std::int64_t stride = 0;  // of the group's innermost non-unit dim
  bool uniform = true;      // the dims fuse into one dim of `stride`
  bool contiguous() const { return uniform && (size <= 1 || stride == 1); }
};

struct MatrixLayout {
  bool fits = false;
  bool row_major = true;
  std::int64_t rows = 0, cols = 0, outer_stride = 1;
};

struct OperandPlan {
  std::vector<std::int64_t> batch, rows, cols;  // dims of each group, in order
  bool transpose = false;                       // copy into [batch..., rows..., cols...] first
  MatrixLayout matrix;
  Strides batch_strides;  // element strides of the batch dims in the (possibly transposed) data
};

struct DotPlan {
  OperandPlan lhs, rhs;
};

inline DimGroup dim_group(const Shape& shape, const Strides& strides, const std::vector<std::int64_t>& dims) {
  DimGroup g;
  bool first = true;
  for (auto d : dims) {
    g.size *= shape[d];
    if (shape[d] == 1) continue;
    if (!first && g.stride != strides[d] * shape[d]) g.uniform = false;
    g.stride = strides[d];
    first = false;
  }
  return g;
}

inline MatrixLayout matrix_layout(const DimGroup& rows, const DimGroup& cols) {
  MatrixLayout m{false, true, rows.size, cols.size, 1};
  if (cols.contiguous() && rows.uniform) {
    m = {true, true, rows.size, cols.size, rows.size <= 1 ? std::max<std::int64_t>(cols.size, 1) : rows.stride};
  } else if (rows.contiguous() && cols.uniform) {
    m = {true, false, rows.size, cols.size, cols.size <= 1 ? std::max<std::int64_t>(rows.size, 1) : cols.stride};
  }
  return m;
}

inline OperandPlan plan_operand(const Shape& shape, std::vector<std::int64_t> batch, std::vector<std::int64_t> rows,
                                std::vector<std::int64_t> cols) {
  const Strides strides = row_major_strides(shape);
  OperandPlan p{std::move(batch), std::move(rows), std::move(cols), false, {}, {}};
  p.matrix = matrix_layout(dim_group(shape, strides, p.rows), dim_group(shape, strides, p.cols));
  if (p.matrix.fits) {
    for (auto d : p.batch) p.batch_strides.push_back(strides[d]);
    return p;
  }
  p.transpose = true;
  p.matrix = {true, true, p.matrix.rows, p.matrix.cols, std::max<std::int64_t>(p.matrix.cols, 1)};
  Shape batch_shape;
  for (auto d : p.batch) batch_shape.push_back(shape[d]);
  p.batch_strides = row_major_strides(batch_shape);
  for (auto& s : p.batch_strides) s *= p.matrix.rows * p.matrix.cols;
  return p;
}

// The contracting dims may be paired in any order; a group can only be mapped in place in memory order,
// so try ascending lhs order and ascending rhs order and keep the plan that copies fewer elements.
inline DotPlan plan_dot(const Shape& lhs, const Shape& rhs, const DotDims& d) {
  auto free_dims = [](const Shape& shape, const std::vector<std::int64_t>& batch, const std::vector<std::int64_t>& contract) {
    std::vector<std::int64_t> free;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(shape.size()); ++i)
      if (std::find(batch.begin(), batch.end(), i) == batch.end() &&
          std::find(contract.begin(), contract.end(), i) == contract.end())
        free.push_back(i);
    return free;
  };
  const auto lhs_free = free_dims(lhs, d.lhs_batch, d.lhs_contract);
  const auto rhs_free = free_dims(rhs, d.rhs_batch, d.rhs_contract);
  auto plan_for = [&](bool by_lhs) {
    std::vector<std::size_t> order(d.lhs_contract.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    const auto& key = by_lhs ? d.lhs_contract : d.rhs_contract;
    std::sort(order.begin(), order.end(), [&](auto a, auto b) { return key[a] < key[b]; });
    std::vector<std::int64_t> lc, rc;
    for (auto i : order) {
      lc.push_back(d.lhs_contract[i]);
      rc.push_back(d.rhs_contract[i]);
    }
    return DotPlan{plan_operand(lhs, d.lhs_batch, lhs_free, lc), plan_operand(rhs, d.rhs_batch, rc, rhs_free)};
  };
  auto copied = [&](const DotPlan& p) {
    return (p.lhs.transpose ? num_elements(lhs) : 0) + (p.rhs.transpose ? num_elements(rhs) : 0);
  };
  DotPlan by_lhs = plan_for(true), by_rhs = plan_for(false);
  return copied(by_rhs) < copied(by_lhs) ? by_rhs : by_lhs;
}

}  // namespace partir::kernels
