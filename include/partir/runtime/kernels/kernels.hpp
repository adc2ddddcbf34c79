#pragma once
// Single-device CPU kernels: one per op kind, on row-major Arrays, through Eigen/Core maps of their buffers
// (no Eigen Tensor module: it would add seconds of compile time to every translation unit).
// Float math is instantiated for f32 and f64 only; ops that move, compare or sum data also take i32.
// bf16 and f16 are storage types: ops that move data copy their 16-bit words, elementwise ones run as fused
// groups in f32 registers (fusion.hpp, a lone op too), every other op widens its 16-bit operands to f32, runs
// the f32 kernel and rounds the result back (eval_in_f32), so sums and dots accumulate in f32. A bf16
// dot_general or convolution is one oneDNN bf16 primitive (f32 accumulation) where the engine allows it.
// Every layout op (broadcast, transpose, slice, pad, concatenate) is one strided copy, and dot_general is
// one batched oneDNN matmul or a loop of GEMMs (BLAS or Eigen; see gemm_engine.hpp) on the operands in place
// wherever their layout allows it.

// GCC 12 warns falsely about the _mm512_undefined_* temporaries of its own AVX-512 intrinsics once they are
// inlined into Eigen's kernels (GCC PR105593). The pragma silences them when this header is the first to
// include Eigen (it has to cover the intrinsics headers), and covers this header's code too.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <type_traits>

#include "partir/ir/op.hpp"
#include "partir/runtime/kernels/array.hpp"
#include "partir/runtime/kernels/blas.hpp"
#include "partir/runtime/kernels/buffer_cache.hpp"
#include "partir/runtime/kernels/dot_plan.hpp"
#include "partir/runtime/kernels/elements.hpp"
#include "partir/runtime/kernels/eval.hpp"
#include "partir/runtime/kernels/gemm_engine.hpp"
#include "partir/runtime/kernels/kernel_threads.hpp"
#include "partir/runtime/kernels/onednn.hpp"
#include "partir/runtime/kernels/strides.hpp"
#include "partir/runtime/kernels/window.hpp"

#if !PARTIR_DEFINE_ENTRIES
#error "partir/runtime/kernels/kernels.hpp holds what libpartir compiles; with PARTIR_SEPARATE_COMPILATION include partir/runtime/kernels/eval.hpp, or build this translation unit header-only"
#endif

namespace partir {

namespace kernels {

template <class T> using Vec = Eigen::Array<T, Eigen::Dynamic, 1>;
template <class T> Eigen::Map<const Vec<T>> vec(const Array& a) { return {ptr<T>(a), a.size()}; }
template <class T> Eigen::Map<Vec<T>> vec(Array& a) { return {ptr<T>(a), a.size()}; }

// Eigen evaluates a dynamic-size expression with vector code in the middle and scalar code at the ends,
// where the ends depend on the buffer's address; vector and scalar exp, log, tanh, pow, sqrt, rsqrt and
// sums differ in the last bits, so results would change with malloc's whims. Elementwise math and sums
// therefore go through fixed-size blocks (one 64-byte vector), indexed from the start of the data only.
template <class T> constexpr std::int64_t block_size = 64 / sizeof(T);
template <class T> using Block = Eigen::Array<T, block_size<T>, 1>;

// out[i] = f(in[i]...) with every element computed by the same vector code: the bits of a result depend
// only on its inputs, not on its address or position (a sharded elementwise op matches the unsharded one).
template <class T, class F, class... In>
void blockwise(std::int64_t n, T* out, F&& f, const In*... in) {
  constexpr std::int64_t b = block_size<T>;
  auto at = [&](std::int64_t i) { Eigen::Map<Block<T>>(out + i) = f(Eigen::Map<const Block<In>>(in + i)...); };
  if (n >= b) {
    for (std::int64_t i = 0; i + b <= n; i += b) at(i);
    if (n % b) at(n - b);  // the last elements, overlapping the previous block: same code, same values
  } else if (n > 0) {
    auto padded = [n](const auto* x) {  // short data: pad a block with a valid input value
      Block<std::remove_const_t<std::remove_pointer_t<decltype(x)>>> blk;
      blk.setConstant(x[0]);
      std::copy_n(x, n, blk.data());
      return blk;
    };
    const Block<T> result = f(padded(in)...);
    std::copy_n(result.data(), n, out);
  }
}

// A sum whose order depends on n alone: block-wise partial sums, then the block's lanes.
template <class T>
T ordered_sum(const T* x, std::int64_t n) {
  constexpr std::int64_t b = block_size<T>;
  Block<T> acc = Block<T>::Zero();
  std::int64_t i = 0;
  for (; i + b <= n; i += b) acc += Eigen::Map<const Block<T>>(x + i);
  for (std::int64_t lane = 0; i < n; ++i, ++lane) acc[lane] += x[i];
  return acc.sum();
}

// dst[i] = src[i] for every index i of `shape`, each side with its own element strides. Transpose and slice
// read strided, pad and concatenate write strided, broadcast reads with stride 0.
template <class T>
void strided_copy(Shape shape, const T* src, Strides src_strides, T* dst, Strides dst_strides) {
  if (num_elements(shape) == 0) return;
  std::array<Strides, 2> strides{std::move(src_strides), std::move(dst_strides)};
  simplify(shape, strides);
  if (shape.empty()) {
    *dst = *src;
    return;
  }
  const std::size_t inner = shape.size() - 1;
  const std::int64_t n = shape[inner], src_step = strides[0][inner], dst_step = strides[1][inner];
  if (dst_step == 1 && src_step > 1) {
    // A transpose: the source is contiguous along another dim k. Copy square tiles through a local buffer,
    // reading along source rows and writing along destination rows, so that both sides move whole cache
    // lines (reading a large matrix down its columns thrashes a single cache set).
    const auto k = static_cast<std::size_t>(std::find(strides[0].begin(), strides[0].end(), 1) - strides[0].begin());
    if (k < inner) {
      constexpr std::int64_t tile = 32;
      const std::int64_t nk = shape[k], dst_k = strides[1][k];
      Shape outer;
      std::array<Strides, 2> outer_strides;
      for (std::size_t d = 0; d < inner; ++d) {
        if (d == k) continue;
        outer.push_back(shape[d]);
        for (std::size_t s = 0; s < 2; ++s) outer_strides[s].push_back(strides[s][d]);
      }
      for_each_index<2>(outer, outer_strides, [&](const auto& off) {
        const T* from = src + off[0];
        T* to = dst + off[1];
        T buffer[tile][tile];  // [along inner][along k]
        for (std::int64_t i0 = 0; i0 < n; i0 += tile)
          for (std::int64_t j0 = 0; j0 < nk; j0 += tile) {
            const std::int64_t ni = std::min(tile, n - i0), nj = std::min(tile, nk - j0);
            for (std::int64_t i = 0; i < ni; ++i) std::copy_n(from + (i0 + i) * src_step + j0, nj, buffer[i]);
            for (std::int64_t j = 0; j < nj; ++j)
              for (std::int64_t i = 0; i < ni; ++i) to[(j0 + j) * dst_k + i0 + i] = buffer[i][j];
          }
      });
      return;
    }
  }
  shape.pop_back();
  strides[0].pop_back();
  strides[1].pop_back();
  for_each_index<2>(shape, strides, [&](const auto& off) {
    const T* from = src + off[0];
    T* to = dst + off[1];
    if (src_step == 1 && dst_step == 1) std::copy_n(from, n, to);
    else if (src_step == 0 && dst_step == 1) std::fill_n(to, n, *from);
    else
      for (std::int64_t i = 0; i < n; ++i) to[i * dst_step] = from[i * src_step];
  });
}

template <class T>
void broadcast_in_dim(const Array& x, const Attrs& a, Array& out) {
  const Strides xs = row_major_strides(x.shape());
  Strides src(a.shape.size(), 0);  // new dims and expanded size-1 dims re-read the same elements
  for (std::size_t i = 0; i < a.dims.size(); ++i)
    if (x.shape()[i] != 1) src[a.dims[i]] = xs[i];
  strided_copy(a.shape, ptr<T>(x), src, ptr<T>(out), row_major_strides(a.shape));
}

template <class T>
void transpose(const Array& x, const Attrs& a, Array& out) {
  const Strides xs = row_major_strides(x.shape());
  Strides src;
  for (auto d : a.dims) src.push_back(xs[d]);
  strided_copy(out.shape(), ptr<T>(x), src, ptr<T>(out), row_major_strides(out.shape()));
}

template <class T>
void slice(const Array& x, const Attrs& a, Array& out) {
  const Strides xs = row_major_strides(x.shape());
  std::int64_t start = 0;
  for (std::size_t d = 0; d < xs.size(); ++d) start += a.lo[d] * xs[d];
  strided_copy(out.shape(), ptr<T>(x) + start, xs, ptr<T>(out), row_major_strides(out.shape()));
}

template <class T>
void pad(const Array& x, const Attrs& a, Array& out) {
  std::fill_n(ptr<T>(out), out.size(), T{});
  const Strides os = row_major_strides(out.shape());
  std::int64_t start = 0;
  for (std::size_t d = 0; d < os.size(); ++d) start += a.lo[d] * os[d];
  strided_copy(x.shape(), ptr<T>(x), row_major_strides(x.shape()), ptr<T>(out) + start, os);
}

template <class T, class Parts>
void concatenate(const Parts& parts, std::int64_t axis, Array& out) {
  const Strides os = row_major_strides(out.shape());
  std::int64_t at = 0;
  for (const Array* part : parts) {
    strided_copy(part->shape(), ptr<T>(*part), row_major_strides(part->shape()), ptr<T>(out) + at * os[axis], os);
    at += part->shape()[axis];
  }
}

// table [V, F...], indices [I...] -> [I..., F...]
template <class T>
void gather(const Array& table, const Array& indices, Array& out) {
  const std::int64_t rows = table.shape()[0], row = num_elements(Shape(table.shape().begin() + 1, table.shape().end()));
  const auto index = indices.data<std::int32_t>();
  for (std::size_t i = 0; i < index.size(); ++i) {
    const auto r = checked_row(index[i], rows, OpKind::gather, table.type());
    std::copy_n(ptr<T>(table) + r * row, row, ptr<T>(out) + static_cast<std::int64_t>(i) * row);
  }
}

// indices [I...], updates [I..., F...] -> [V, F...]
template <class T>
void scatter_add(const Array& indices, const Array& updates, Array& out) {
  vec<T>(out).setZero();
  const std::int64_t rows = out.shape()[0], row = num_elements(Shape(out.shape().begin() + 1, out.shape().end()));
  const auto index = indices.data<std::int32_t>();
  for (std::size_t i = 0; i < index.size(); ++i) {
    const auto r = checked_row(index[i], rows, OpKind::scatter_add, out.type());
    Eigen::Map<Vec<T>>(ptr<T>(out) + r * row, row) +=
        Eigen::Map<const Vec<T>>(ptr<T>(updates) + static_cast<std::int64_t>(i) * row, row);
  }
}

// Below this many rows + contracting + columns a GEMM is a few sums, computed in a fixed order (see batched_gemm).
inline constexpr std::int64_t gemm_min_size = 20;

// A convolution's geometry as oneDNN's primitives take it, also the one the im2col path below reads.
inline onednn::Convolution convolution_geometry(const Shape& x, const Shape& w, const Shape& out, const Attrs& a) {
  const auto spatial = static_cast<std::ptrdiff_t>(x.size()) - 2;
  const auto& c = a.conv;
  return {x[0], x.back(), w.back(), c.feature_groups, Shape(x.begin() + 1, x.end() - 1),
          Shape(w.begin(), w.begin() + spatial), Shape(out.begin() + 1, out.end() - 1), c.strides, c.lhs_dilation,
          c.rhs_dilation, a.lo, a.hi, c.flip};
}

// The convolution by oneDNN's primitives where oneDNN is the GEMM engine in use and takes T and the geometry
// (onednn::convolution); false otherwise.
template <class T>
bool onednn_convolution(const onednn::Convolution& geometry, const Array& x, const Array& w, Array& out) {
  return gemm_engine() == GemmEngine::onednn && onednn::convolution<T>(geometry, ptr<T>(x), ptr<T>(w), ptr<T>(out));
}

// x [N, spatial..., C], w [window..., C / G, O] -> out [N, spatial'..., O] (ConvDims in op.hpp; G feature groups).
// oneDNN's primitives where they apply (above), else im2col: row p of an image's patches holds its group's C / G
// features under each tap of output position p's window (zeros off the input or between dilated elements), taps
// major; then per group one GEMM
// [images x P, taps x C/G] x [taps x C/G, O/G] on the GEMM engine in use (gemm_engine.hpp), the kernel's and the
// result's columns of the group strided by O, per batch of images whose patches fit in 64 MiB.
template <class T>
void convolution(const Array& x, const Array& w, const Attrs& a, Array& out) {
  const onednn::Convolution geometry = convolution_geometry(x.shape(), w.shape(), out.shape(), a);
  const std::int64_t N = geometry.images, C = geometry.in_features, O = geometry.out_features, G = geometry.groups;
  const std::int64_t Cg = C / G, Og = O / G;
  const WindowShape s = window_shape(OpKind::convolution, geometry.in, geometry.window, geometry.out, a);
  const std::int64_t P = s.positions, K = s.taps, X = num_elements(geometry.in), row = K * Cg;
  if (N * P * O == 0 || onednn_convolution<T>(geometry, x, w, out)) return;
  // The input position each (output position, tap) reads, -1 for padding and dilation holes: the same in every image.
  std::vector<std::int64_t> source(static_cast<std::size_t>(P * K));
  for (std::int64_t p = 0; p < P; ++p)
    for (std::int64_t k = 0; k < K; ++k) source[static_cast<std::size_t>(p * K + k)] = window_source(s, p, k);
  const std::int64_t images_per_gemm = std::clamp<std::int64_t>(
      (std::int64_t{64} << 20) / static_cast<std::int64_t>(sizeof(T)) / std::max<std::int64_t>(P * row, 1), 1, N);
  std::vector<T> patches(static_cast<std::size_t>(images_per_gemm * P * row));
  std::vector<T> staged(G > 1 ? patches.size() / static_cast<std::size_t>(row) * static_cast<std::size_t>(Og) : 0);
  const std::vector<std::int64_t> no_batch;
  using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Strided = Eigen::OuterStride<>;
  for (std::int64_t first = 0; first < N; first += images_per_gemm) {
    const std::int64_t images = std::min(images_per_gemm, N - first), m = images * P;
    for (std::int64_t g = 0; g < G; ++g) {
      for (std::int64_t n = 0; n < images; ++n)
        for (std::int64_t p = 0; p < P; ++p)
          for (std::int64_t k = 0; k < K; ++k) {
            T* dst = patches.data() + ((n * P + p) * K + k) * Cg;
            const std::int64_t s = source[static_cast<std::size_t>(p * K + k)];
            if (s < 0) std::fill_n(dst, Cg, T(0));
            else std::copy_n(ptr<T>(x) + ((first + n) * X + s) * C + g * Cg, Cg, dst);
          }
      const T* kernel = ptr<T>(w) + g * Og;              // [taps x C/G, O/G], rows O apart
      T* result = ptr<T>(out) + first * P * O + g * Og;  // [m, O/G], rows O apart
      const bool large = m + row + Og >= gemm_min_size;
      if (large && gemm_engine() == GemmEngine::onednn &&  // oneDNN writes dense rows: a group's are staged
          onednn::matmul<T>(no_batch, {no_batch, true, row}, {no_batch, true, O}, m, Og, row, patches.data(), kernel,
                            G > 1 ? staged.data() : result)) {
        for (std::int64_t i = 0; G > 1 && i < m; ++i) std::copy_n(staged.data() + i * Og, Og, result + i * O);
        continue;
      }
      if (large && gemm_engine() != GemmEngine::eigen &&
          blas::gemm<T>(true, true, m, Og, row, patches.data(), row, kernel, O, result, O))
        continue;
      Eigen::Map<Matrix, 0, Strided>(result, m, Og, Strided(O)).noalias() =
          Eigen::Map<const Matrix>(patches.data(), m, row) *
          Eigen::Map<const Matrix, 0, Strided>(kernel, row, Og, Strided(O));
    }
  }
}

// reduce_window_* (take_max: max, else sum) and select_and_scatter (WindowDims in op.hpp): one visit per output
// position and tap, taps in row-major order; taps on padding or between dilated elements hold the identity.
// select_and_scatter adds g at each window's first maximum of x (as XLA's select `ge` and PyTorch's max_pool
// backward pick it); a window of padding only adds nowhere.
template <class T, OpKind kind>
void windows(const Array& x, const Array* g, const Attrs& a, Array& out) {
  const WindowShape s =
      window_shape(kind, x.shape(), a.window.window, kind == OpKind::select_and_scatter ? g->shape() : out.shape(), a);
  constexpr bool take_max = kind != OpKind::reduce_window_sum;
  if (kind == OpKind::select_and_scatter) vec<T>(out).setZero();
  for (std::int64_t o = 0; o < s.positions; ++o) {
    T best = take_max ? -std::numeric_limits<T>::infinity() : T(0);
    std::int64_t best_at = -1;
    for (std::int64_t k = 0; k < s.taps; ++k) {
      const std::int64_t at = window_source(s, o, k);
      if (at < 0) continue;
      const T v = ptr<T>(x)[at];
      if (!take_max) best += v;
      else if (best_at < 0 || v > best) best = v, best_at = at;
    }
    if (kind == OpKind::select_and_scatter) {
      if (best_at >= 0) ptr<T>(out)[best_at] += ptr<T>(*g)[o];
    } else {
      ptr<T>(out)[o] = best;
    }
  }
}

// Walks the input once in memory order. After fusing dims, the innermost run is either reduced (one
// vectorized sum/max per run) or kept (added as a vector into the output row), which covers both
// "reduce the last dims" and "reduce the leading dims" without strided inner loops. A 16-bit input (S) is
// widened one run at a time into f32 (T): the same f32 sums as of a widened copy, without the copy's pass.
// A large reduction whose leading dim is kept (a layer norm's statistics, row by row) splits that dim over the
// kernel threads: each output element is still summed by one thread in the same order, whatever the split.
// Splitting a kept run's columns instead (a bias gradient, summed over rows) ran slower: each thread read
// half of every row, and the prefetchers stop at each page.
template <class T, bool take_max, class S = T>
void reduce(const Array& x, const std::vector<std::int64_t>& dims, Array& out) {
  const T identity = !take_max                              ? T(0)
                     : std::numeric_limits<T>::has_infinity ? -std::numeric_limits<T>::infinity()
                                                            : std::numeric_limits<T>::lowest();
  vec<T>(out).setConstant(identity);
  if (x.size() == 0) return;
  Shape shape = x.shape();
  const Strides os = row_major_strides(out.shape());
  std::array<Strides, 2> strides{row_major_strides(shape), Strides(shape.size(), 0)};  // reduced dims: 0
  for (std::size_t d = 0, kept = 0; d < shape.size(); ++d)
    if (std::find(dims.begin(), dims.end(), static_cast<std::int64_t>(d)) == dims.end()) strides[1][d] = os[kept++];
  simplify(shape, strides);
  if (shape.empty()) {
    ptr<T>(out)[0] = static_cast<T>(ptr<S>(x)[0]);
    return;
  }
  const std::int64_t n = shape.back();
  const bool reduce_run = strides[1].back() == 0;
  shape.pop_back();
  strides[0].pop_back();
  strides[1].pop_back();
  const S* src = ptr<S>(x);
  T* dst = ptr<T>(out);
  // The runs whose leading outer index is in [lo, hi).
  auto reduce_part = [&](std::int64_t lo, std::int64_t hi) {
    std::vector<T> widened_run(is_half_type<S> ? static_cast<std::size_t>(n) : 0);
    Shape part = shape;
    if (!part.empty()) part[0] = hi - lo;
    const std::int64_t start0 = part.empty() ? 0 : lo * strides[0][0], start1 = part.empty() ? 0 : lo * strides[1][0];
    for_each_index<2>(part, strides, [&](const auto& off) {
      const T* from;
      if constexpr (is_half_type<S>) {
        convert_elements(src + start0 + off[0], widened_run.data(), n);
        from = widened_run.data();
      } else {
        from = src + start0 + off[0];
      }
      Eigen::Map<const Vec<T>> run(from, n);
      if (reduce_run) {
        T& acc = dst[start1 + off[1]];
        acc = take_max ? std::max(acc, run.maxCoeff()) : acc + ordered_sum(from, n);
      } else {
        Eigen::Map<Vec<T>> acc(dst + start1 + off[1], n);
        if constexpr (take_max) acc = acc.max(run);
        else acc += run;
      }
    });
  };
  if (reduce_run && !shape.empty() && strides[1][0] != 0)  // the leading dim is kept: its indices split
    split_over_kernel_threads(shape[0], 1, reduce_part, x.size());
  else
    reduce_part(0, shape.empty() ? 1 : shape[0]);
}

// The operand's data in its plan's layout: the Array itself, or a transposed copy in scratch.
template <class T>
const T* operand_data(const Array& x, const OperandPlan& p, std::vector<T>& scratch) {
  if (!p.transpose) return ptr<T>(x);
  const Strides xs = row_major_strides(x.shape());
  Shape shape;
  Strides src;
  for (const auto* group : {&p.batch, &p.rows, &p.cols})
    for (auto d : *group) {
      shape.push_back(x.shape()[d]);
      src.push_back(xs[d]);
    }
  scratch.resize(static_cast<std::size_t>(x.size()));
  strided_copy(shape, ptr<T>(x), src, scratch.data(), row_major_strides(shape));
  return scratch.data();
}

template <class T, int Order>
using MatrixMap =
    Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>, Eigen::Unaligned, Eigen::OuterStride<>>;

template <class T, int LhsOrder, int RhsOrder>
void batched_gemm(const Shape& batch, const T* lhs, const OperandPlan& l, const T* rhs, const OperandPlan& r, T* out) {
  const MatrixLayout &a = l.matrix, &b = r.matrix;
  const GemmEngine engine = gemm_engine();
  Strides out_strides = row_major_strides(batch);
  for (auto& s : out_strides) s *= a.rows * b.cols;
  for_each_index<3>(batch, {l.batch_strides, r.batch_strides, out_strides}, [&](const auto& off) {
    MatrixMap<T, LhsOrder> lm(lhs + off[0], a.rows, a.cols, Eigen::OuterStride<>(a.outer_stride));
    MatrixMap<T, RhsOrder> rm(rhs + off[1], b.rows, b.cols, Eigen::OuterStride<>(b.outer_stride));
    Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> om(out + off[2], a.rows, b.cols);
    if (a.rows + a.cols + b.cols >= gemm_min_size) {
      // oneDNN has no f64 matmul: under the onednn engine f64 runs on BLAS where it is built in.
      if (engine != GemmEngine::eigen &&
          blas::gemm<T>(a.row_major, b.row_major, a.rows, b.cols, a.cols, lhs + off[0], a.outer_stride, rhs + off[1],
                        b.outer_stride, out + off[2], b.cols))
        return;
      om.noalias() = lm * rm;
      return;
    }
    // Below this size Eigen computes coefficient by coefficient, splitting vector and scalar code by the
    // buffer's address (see blockwise); these few sums are computed here in a fixed order instead.
    for (std::int64_t i = 0; i < a.rows; ++i)
      for (std::int64_t j = 0; j < b.cols; ++j) {
        T sum = 0;
        for (std::int64_t k = 0; k < a.cols; ++k) sum += lm(i, k) * rm(k, j);
        om(i, j) = sum;
      }
  });
}

// Returns false for a 16-bit T that oneDNN does not run here (the caller then computes in f32).
template <class T>
bool dot_general(const Array& lhs, const Array& rhs, const DotDims& d, Array& out) {
  const DotPlan plan = plan_dot(lhs.shape(), rhs.shape(), d);
  std::vector<T> lhs_scratch, rhs_scratch;
  const T* l = operand_data(lhs, plan.lhs, lhs_scratch);
  const T* r = operand_data(rhs, plan.rhs, rhs_scratch);
  Shape batch;
  for (auto b : d.lhs_batch) batch.push_back(lhs.shape()[b]);
  const bool lrow = plan.lhs.matrix.row_major, rrow = plan.rhs.matrix.row_major;
  const MatrixLayout &a = plan.lhs.matrix, &b = plan.rhs.matrix;
  if (gemm_engine() == GemmEngine::onednn && a.rows + a.cols + b.cols >= gemm_min_size &&
      onednn::matmul<T>(batch, {plan.lhs.batch_strides, lrow, a.outer_stride}, {plan.rhs.batch_strides, rrow, b.outer_stride},
                        a.rows, b.cols, a.cols, l, r, ptr<T>(out)))
    return true;
  if constexpr (is_half_type<T>) {
    return false;
  } else {
    constexpr int R = Eigen::RowMajor, C = Eigen::ColMajor;
    if (lrow && rrow) batched_gemm<T, R, R>(batch, l, plan.lhs, r, plan.rhs, ptr<T>(out));
    else if (lrow) batched_gemm<T, R, C>(batch, l, plan.lhs, r, plan.rhs, ptr<T>(out));
    else if (rrow) batched_gemm<T, C, R>(batch, l, plan.lhs, r, plan.rhs, ptr<T>(out));
    else batched_gemm<T, C, C>(batch, l, plan.lhs, r, plan.rhs, ptr<T>(out));
    return true;
  }
}

template <class T>
void unary(OpKind kind, const Array& x, Array& out) {
  auto apply = [&](auto f) { blockwise(x.size(), ptr<T>(out), f, ptr<T>(x)); };
  switch (kind) {
    case OpKind::neg: apply([](const auto& a) { return -a; }); break;
    case OpKind::exp: apply([](const auto& a) { return a.exp(); }); break;
    case OpKind::log: apply([](const auto& a) { return a.log(); }); break;
    case OpKind::tanh: apply([](const auto& a) { return a.tanh(); }); break;
    case OpKind::rsqrt: apply([](const auto& a) { return a.rsqrt(); }); break;
    case OpKind::sqrt: apply([](const auto& a) { return a.sqrt(); }); break;
    case OpKind::abs: apply([](const auto& a) { return a.abs(); }); break;
    default: internal_error("unary kernel called for " + std::string(name_of(kind)));
  }
}

template <class T>
void binary(OpKind kind, const Array& x, const Array& y, Array& out) {
  auto apply = [&](auto f) { blockwise(x.size(), ptr<T>(out), f, ptr<T>(x), ptr<T>(y)); };
  switch (kind) {
    case OpKind::add: apply([](const auto& a, const auto& b) { return a + b; }); break;
    case OpKind::sub: apply([](const auto& a, const auto& b) { return a - b; }); break;
    case OpKind::mul: apply([](const auto& a, const auto& b) { return a * b; }); break;
    case OpKind::div: apply([](const auto& a, const auto& b) { return a / b; }); break;
    case OpKind::max: apply([](const auto& a, const auto& b) { return a.max(b); }); break;
    case OpKind::min: apply([](const auto& a, const auto& b) { return a.min(b); }); break;
    case OpKind::pow: apply([](const auto& a, const auto& b) { return a.pow(b); }); break;
    default: internal_error("binary kernel called for " + std::string(name_of(kind)));
  }
}

// The mask is 1/0 in the operands' own type.
template <class T>
void compare(CompareDir dir, const Array& x, const Array& y, Array& out) {
  auto a = vec<T>(x), b = vec<T>(y);
  auto r = vec<T>(out);
  switch (dir) {
    case CompareDir::eq: r = (a == b).template cast<T>(); break;
    case CompareDir::ne: r = (a != b).template cast<T>(); break;
    case CompareDir::lt: r = (a < b).template cast<T>(); break;
    case CompareDir::le: r = (a <= b).template cast<T>(); break;
    case CompareDir::gt: r = (a > b).template cast<T>(); break;
    case CompareDir::ge: r = (a >= b).template cast<T>(); break;
  }
}

inline Array constant(const Op& op) {
  Array out = buffer_cache().take(op.type);
  const auto& literal = op.attrs.literal;
  visit_dtype(op.type.dtype, [&](auto t) {
    using T = decltype(t);
    T* r = ptr<T>(out);
    if (literal.size() == 1) {
      T value;
      convert_elements(literal.data(), &value, 1);
      std::fill_n(r, out.size(), value);
    } else {
      convert_elements(literal.data(), r, out.size());
    }
  });
  return out;
}

// x's values as f32, in a cached buffer (give it back when done).
inline Array widened(const Array& x) {
  Array out = buffer_cache().take({x.shape(), DType::f32});
  visit_dtype(x.dtype(), [&](auto t) { convert_elements(ptr<decltype(t)>(x), ptr<float>(out), x.size()); });
  return out;
}

inline bool moves_data(OpKind kind) {
  using K = OpKind;
  return kind == K::broadcast_in_dim || kind == K::reshape || kind == K::transpose || kind == K::slice ||
         kind == K::pad || kind == K::concatenate || kind == K::gather || kind == K::convert;
}

// An f32 result rounded into `type` (16-bit); its buffer goes back to the cache.
inline Array narrowed(Array wide, const TensorType& type) {
  Array out = buffer_cache().take(type);
  visit_dtype(type.dtype, [&](auto t) { convert_elements(ptr<float>(wide), ptr<decltype(t)>(out), out.size()); });
  buffer_cache().give(std::move(wide));
  return out;
}

// A computing op with 16-bit operands or result: run in f32 on widened copies, rounded back to op's dtype.
inline Array eval_in_f32(const Op& op, std::span<const Array* const> operands) {
  Op wide = op;
  if (is_half(wide.type.dtype)) wide.type.dtype = DType::f32;
  std::vector<Array> copies;
  copies.reserve(operands.size());
  std::vector<const Array*> args;
  for (const Array* x : operands) {
    if (!is_half(x->dtype())) {
      args.push_back(x);
      continue;
    }
    copies.push_back(widened(*x));
    args.push_back(&copies.back());
  }
  Array result = eval(wide, args);
  for (auto& c : copies) buffer_cache().give(std::move(c));
  return result.dtype() == op.type.dtype ? result : narrowed(std::move(result), op.type);
}
}  // namespace kernels

PARTIR_ENTRY Array eval(const Op& op, std::span<const Array* const> operands) {
  using K = OpKind;
  namespace k = kernels;
  if (op.kind == K::input) internal_error("eval: input '" + op.name + "' has no kernel; the caller binds inputs");
  if (op.kind == K::constant) return k::constant(op);
  const Array& x = *operands[0];
  const auto& a = op.attrs;
  if ((is_half(op.type.dtype) || is_half(x.dtype())) && !k::moves_data(op.kind)) {
    const bool bf16_matmul = op.kind == K::dot_general && op.type.dtype == DType::bf16;
    if (bf16_matmul || (op.kind == K::convolution && op.type.dtype == DType::bf16)) {  // operands of one dtype
      Array out = k::buffer_cache().take(op.type);
      if (bf16_matmul ? k::dot_general<bf16>(x, *operands[1], a.dot, out)
                      : out.size() > 0 &&
                            k::onednn_convolution<bf16>(k::convolution_geometry(x.shape(), operands[1]->shape(), out.shape(), a),
                                                        x, *operands[1], out))
        return out;
      k::buffer_cache().give(std::move(out));
    }
    if ((op.kind == K::reduce_sum || op.kind == K::reduce_max) && is_half(x.dtype())) {
      Array wide = k::buffer_cache().take({op.type.shape, DType::f32});
      k::visit_dtype(x.dtype(), [&](auto s) {
        if constexpr (is_half_type<decltype(s)>) {
          if (op.kind == K::reduce_sum) k::reduce<float, false, decltype(s)>(x, a.dims, wide);
          else k::reduce<float, true, decltype(s)>(x, a.dims, wide);
        }
      });
      return k::narrowed(std::move(wide), op.type);
    }
    return k::eval_in_f32(op, operands);
  }
  Array out = k::buffer_cache().take(op.type);  // contents unspecified: every kernel writes all of it
  auto each_type = [&](auto&& f) { k::visit_math_dtype(x.dtype(), f); };
  auto each_stored_type = [&](auto&& f) { k::visit_dtype(x.dtype(), f); };
  switch (op.kind) {
    case K::neg: case K::exp: case K::log: case K::tanh: case K::rsqrt: case K::sqrt: case K::abs:
      k::visit_float_dtype(x.dtype(), op.kind, [&](auto t) { k::unary<decltype(t)>(op.kind, x, out); });
      break;
    case K::add: case K::sub: case K::mul: case K::div: case K::max: case K::min: case K::pow:
      k::visit_float_dtype(x.dtype(), op.kind,
                           [&](auto t) { k::binary<decltype(t)>(op.kind, x, *operands[1], out); });
      break;
    case K::compare:
      each_type([&](auto t) { k::compare<decltype(t)>(a.cmp, x, *operands[1], out); });
      break;
    case K::select:
      k::visit_math_dtype(out.dtype(), [&](auto t) {
        using T = decltype(t);
        each_type([&](auto m) {
          using M = decltype(m);
          k::vec<T>(out) = (k::vec<M>(x) != M(0)).select(k::vec<T>(*operands[1]), k::vec<T>(*operands[2]));
        });
      });
      break;
    case K::convert:
      each_stored_type([&](auto from) {
        k::visit_dtype(out.dtype(), [&](auto to) {
          using From = decltype(from);
          using To = decltype(to);
          if constexpr (is_half_type<From> || is_half_type<To>)
            split_over_kernel_threads(x.size(), 64, [&](std::int64_t lo, std::int64_t hi) {
              k::convert_elements(k::ptr<From>(x) + lo, k::ptr<To>(out) + lo, hi - lo);
            });
          else
            k::vec<To>(out) = k::vec<From>(x).template cast<To>();
        });
      });
      break;
    case K::dot_general:
      k::visit_float_dtype(x.dtype(), op.kind,
                           [&](auto t) { k::dot_general<decltype(t)>(x, *operands[1], a.dot, out); });
      break;
    case K::reduce_sum:
      each_type([&](auto t) { k::reduce<decltype(t), false>(x, a.dims, out); });
      break;
    case K::reduce_max:
      each_type([&](auto t) { k::reduce<decltype(t), true>(x, a.dims, out); });
      break;
    case K::broadcast_in_dim:
      each_stored_type([&](auto t) { k::broadcast_in_dim<decltype(t)>(x, a, out); });
      break;
    case K::reshape:  // row-major: the same elements in the same order
      out.storage() = x.storage();
      break;
    case K::transpose:
      each_stored_type([&](auto t) { k::transpose<decltype(t)>(x, a, out); });
      break;
    case K::slice:
      each_stored_type([&](auto t) { k::slice<decltype(t)>(x, a, out); });
      break;
    case K::pad:
      each_stored_type([&](auto t) { k::pad<decltype(t)>(x, a, out); });
      break;
    case K::concatenate:
      each_stored_type([&](auto t) { k::concatenate<decltype(t)>(operands, a.axis, out); });
      break;
    case K::convolution:
      k::visit_float_dtype(x.dtype(), op.kind, [&](auto t) { k::convolution<decltype(t)>(x, *operands[1], a, out); });
      break;
    case K::reduce_window_sum:
      k::visit_float_dtype(x.dtype(), op.kind, [&](auto t) { k::windows<decltype(t), K::reduce_window_sum>(x, nullptr, a, out); });
      break;
    case K::reduce_window_max:
      k::visit_float_dtype(x.dtype(), op.kind, [&](auto t) { k::windows<decltype(t), K::reduce_window_max>(x, nullptr, a, out); });
      break;
    case K::select_and_scatter:
      k::visit_float_dtype(x.dtype(), op.kind,
                           [&](auto t) { k::windows<decltype(t), K::select_and_scatter>(x, operands[1], a, out); });
      break;
    case K::gather:
      each_stored_type([&](auto t) { k::gather<decltype(t)>(x, *operands[1], out); });
      break;
    case K::scatter_add:
      k::visit_math_dtype(out.dtype(), [&](auto t) { k::scatter_add<decltype(t)>(x, *operands[1], out); });
      break;
    case K::add_n:  // left to right, as the adds it replaces
      k::visit_float_dtype(x.dtype(), op.kind, [&](auto t) {
        using T = decltype(t);
        std::copy_n(k::ptr<T>(x), x.size(), k::ptr<T>(out));
        for (std::size_t i = 1; i < operands.size(); ++i) k::binary<T>(K::add, out, *operands[i], out);
      });
      break;
    case K::input: case K::constant: case K::count_:
      internal_error("eval: unexpected op kind");
  }
  return out;
}

}  // namespace partir
#pragma GCC diagnostic pop

#include "partir/runtime/kernels/fused_kernel.hpp"  // eval_fused: the other entry point (eval.hpp)
