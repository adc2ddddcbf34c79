#pragma once
// CUDA kernels behind gpu/launch.hpp. Include this in exactly ONE .cu file of a program compiled by nvcc
// (the definitions are not inline, so the host compiler's translation units only see launch.hpp).
// Each kernel takes the op kind as a run-time switch rather than a template parameter: a few instantiations
// per dtype keep nvcc's compile time small, and the switch costs nothing next to memory traffic.
// bf16 and f16 are stored as CUDA's __nv_bfloat16 and __half and computed in f32 registers, as on the CPU:
// each kernel widens what it loads (widen) and rounds what it stores to nearest even (Store<T>::from).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "partir/runtime/gpu/launch.hpp"

namespace partir::gpu {
namespace device {

constexpr int threads = 256;

inline unsigned blocks_for(std::int64_t n) {
  const std::int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 65535 * 32 ? (b < 1 ? 1 : b) : 65535 * 32);  // grid-stride loops cover the rest
}

inline void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    user_error(std::string("cuda: launching ") + kernel + " failed: " + cudaGetErrorName(e) + " (" +
               cudaGetErrorString(e) + ")");
}

#define PARTIR_GRID_LOOP(i, n) \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); i += static_cast<std::int64_t>(blockDim.x) * gridDim.x)

// The type a kernel computes a T in: f32 for the 16-bit floats, T itself otherwise.
template <class T> struct MathOf { using type = T; };
template <> struct MathOf<__nv_bfloat16> { using type = float; };
template <> struct MathOf<__half> { using type = float; };
template <class T> using math_t = typename MathOf<T>::type;

template <class T> __device__ math_t<T> widen(T v) { return v; }
template <> __device__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ float widen(__half v) { return __half2float(v); }

// A computed value stored as T. Into a 16-bit float, from f64 (and i32, exact in f64) in one rounding, as
// the CPU's round-to-odd path gives.
template <class T> struct Store {
  template <class V> __device__ static T from(V v) { return static_cast<T>(v); }
};
template <> struct Store<__nv_bfloat16> {
  __device__ static __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
  __device__ static __nv_bfloat16 from(double v) { return __double2bfloat16(v); }
  __device__ static __nv_bfloat16 from(std::int32_t v) { return __double2bfloat16(static_cast<double>(v)); }
};
template <> struct Store<__half> {
  __device__ static __half from(float v) { return __float2half_rn(v); }
  __device__ static __half from(double v) { return __double2half(v); }
  __device__ static __half from(std::int32_t v) { return __double2half(static_cast<double>(v)); }
};

template <class T> __device__ T rsqrt_of(T x) { return T(1) / sqrt(x); }

template <class T>
__global__ void unary_kernel(OpKind kind, const T* x, T* out, std::int64_t n) {
  using M = math_t<T>;
  PARTIR_GRID_LOOP(i, n) {
    const M a = widen(x[i]);
    M r;
    switch (kind) {
      case OpKind::neg: r = -a; break;
      case OpKind::exp: r = exp(a); break;
      case OpKind::log: r = log(a); break;
      case OpKind::tanh: r = tanh(a); break;
      case OpKind::rsqrt: r = rsqrt_of(a); break;
      case OpKind::sqrt: r = sqrt(a); break;
      case OpKind::abs: r = fabs(a); break;
      default: r = a; break;
    }
    out[i] = Store<T>::from(r);
  }
}

template <class T>
__global__ void binary_kernel(OpKind kind, const T* x, const T* y, T* out, std::int64_t n) {
  using M = math_t<T>;
  PARTIR_GRID_LOOP(i, n) {
    const M a = widen(x[i]), b = widen(y[i]);
    M r;
    switch (kind) {
      case OpKind::add: r = a + b; break;
      case OpKind::sub: r = a - b; break;
      case OpKind::mul: r = a * b; break;
      case OpKind::div: r = a / b; break;
      case OpKind::max: r = a > b ? a : b; break;  // NaN operands: may differ from Eigen's choice
      case OpKind::min: r = a < b ? a : b; break;
      case OpKind::pow: r = pow(a, b); break;
      default: r = a; break;
    }
    out[i] = Store<T>::from(r);
  }
}

template <class T>
__global__ void compare_kernel(CompareDir dir, const T* x, const T* y, T* out, std::int64_t n) {
  PARTIR_GRID_LOOP(i, n) {
    const math_t<T> a = widen(x[i]), b = widen(y[i]);
    bool r = false;
    switch (dir) {
      case CompareDir::eq: r = a == b; break;
      case CompareDir::ne: r = a != b; break;
      case CompareDir::lt: r = a < b; break;
      case CompareDir::le: r = a <= b; break;
      case CompareDir::gt: r = a > b; break;
      case CompareDir::ge: r = a >= b; break;
    }
    out[i] = Store<T>::from(math_t<T>(r ? 1 : 0));
  }
}

template <class M, class T>
__global__ void select_kernel(const M* m, const T* a, const T* b, T* out, std::int64_t n) {
  PARTIR_GRID_LOOP(i, n) out[i] = widen(m[i]) != math_t<M>(0) ? a[i] : b[i];
}

template <class From, class To>
__global__ void convert_kernel(const From* x, To* out, std::int64_t n) {
  PARTIR_GRID_LOOP(i, n) out[i] = Store<To>::from(widen(x[i]));
}

template <class T>
__global__ void fill_kernel(double value, T* out, std::int64_t n) {
  const T v = Store<T>::from(value);
  PARTIR_GRID_LOOP(i, n) out[i] = v;
}

template <class E>
__global__ void strided_copy_kernel(StridedShape s, std::int64_t n, const E* src, E* dst) {
  PARTIR_GRID_LOOP(i, n) {
    std::int64_t from = 0, to = 0;
    view_offsets(s, i, from, to);
    dst[to] = src[from];
  }
}

template <class T> __device__ T lowest();
template <> __device__ float lowest<float>() { return -INFINITY; }
template <> __device__ double lowest<double>() { return -INFINITY; }
template <> __device__ std::int32_t lowest<std::int32_t>() { return INT_MIN; }

// One block per output element and chunk of its elements (parts chunks per output: reduce_chunk; parts 1:
// all of them), writing out[block]: its threads walk the chunk in a fixed order and combine their partial
// results in a fixed tree, so a result depends on the data only (no atomics). 16-bit inputs accumulate in
// f32 (Out: f32 for the chunks of a split reduction, rounded to 16 bits once at the end).
template <class T, class Out, bool take_max>
__global__ void reduce_kernel(ReduceShape s, std::int64_t parts, const T* x, Out* out) {
  using A = math_t<T>;
  __shared__ A partial[threads];
  for (std::int64_t b = blockIdx.x; b < s.outputs * parts; b += gridDim.x) {
    std::int64_t o = 0, first = 0, last = 0;
    reduce_chunk(s, parts, b, o, first, last);
    const std::int64_t base = kept_offset(s, o);
    A acc = take_max ? lowest<A>() : A(0);
    for (std::int64_t j = first + threadIdx.x; j < last; j += blockDim.x) {
      const A v = widen(x[base + reduced_offset(s, j)]);
      acc = take_max ? (v > acc ? v : acc) : acc + v;
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int width = blockDim.x / 2; width > 0; width /= 2) {
      if (static_cast<int>(threadIdx.x) < width) {
        const A a = partial[threadIdx.x], c = partial[threadIdx.x + width];
        partial[threadIdx.x] = take_max ? (c > a ? c : a) : a + c;
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) out[b] = Store<Out>::from(partial[0]);
    __syncthreads();
  }
}

template <class T, class Out, bool take_max>
void reduce_pass(const ReduceShape& s, std::int64_t parts, const T* x, Out* out, cudaStream_t stream) {
  const std::int64_t blocks = s.outputs * parts;
  const unsigned grid = static_cast<unsigned>(blocks < 65535 * 32 ? blocks : 65535 * 32);
  reduce_kernel<T, Out, take_max><<<grid, threads, 0, stream>>>(s, parts, x, out);
  check_launch("reduce_kernel");
}

// One thread per element of the result or the updates, or per index when rows have no elements
// (table_offset: the index is still checked).
template <class T>
__global__ void gather_kernel(const T* table, const std::int32_t* indices, T* out, std::int64_t n, std::int64_t rows,
                              std::int64_t row, std::int64_t first_row, std::int64_t global_rows, int* bad) {
  PARTIR_GRID_LOOP(k, n * (row > 0 ? row : 1)) {
    const std::int64_t at = table_offset(indices, k, row, rows, first_row, global_rows, bad);
    if (row > 0) out[k] = at >= 0 ? table[at] : Store<T>::from(math_t<T>(0));
  }
}

template <class T>
__global__ void scatter_add_kernel(const std::int32_t* indices, const T* updates, T* out, std::int64_t n,
                                   std::int64_t rows, std::int64_t row, std::int64_t first_row,
                                   std::int64_t global_rows, int* bad) {
  PARTIR_GRID_LOOP(k, n * (row > 0 ? row : 1)) {
    const std::int64_t at = table_offset(indices, k, row, rows, first_row, global_rows, bad);
    if (at >= 0) atomicAdd(out + at, updates[k]);
  }
}

// One thread per output element [n, p, o]: the taps of position p over group o / (O / G)'s input features.
template <class T>
__global__ void convolution_kernel(WindowShape s, std::int64_t images, std::int64_t C, std::int64_t O, std::int64_t G,
                                   const T* x, const T* w, T* out) {
  std::int64_t X = 1;
  for (int d = 0; d < s.rank; ++d) X *= s.in[d];
  const std::int64_t Cg = C / G, Og = O / G;
  PARTIR_GRID_LOOP(i, images * s.positions * O) {
    const std::int64_t o = i % O, p = i / O % s.positions, n = i / O / s.positions;
    math_t<T> sum = 0;
    for (std::int64_t t = 0; t < s.taps; ++t) {
      const std::int64_t at = kernels::window_source(s, p, t);
      if (at < 0) continue;
      const T* xs = x + (n * X + at) * C + o / Og * Cg;
      const T* ws = w + t * Cg * O + o;
      for (std::int64_t c = 0; c < Cg; ++c) sum += widen(xs[c]) * widen(ws[c * O]);
    }
    out[i] = Store<T>::from(sum);
  }
}

template <class T, bool take_max>
__global__ void reduce_window_kernel(WindowShape s, const T* x, T* out) {
  PARTIR_GRID_LOOP(p, s.positions) {
    math_t<T> r = take_max ? lowest<math_t<T>>() : math_t<T>(0);
    for (std::int64_t t = 0; t < s.taps; ++t) {
      const std::int64_t at = kernels::window_source(s, p, t);
      if (at < 0) continue;
      const math_t<T> v = widen(x[at]);
      r = take_max ? (v > r ? v : r) : r + v;
    }
    out[p] = Store<T>::from(r);
  }
}

template <class T>
__global__ void select_and_scatter_kernel(WindowShape s, const T* x, const T* g, T* out) {
  PARTIR_GRID_LOOP(p, s.positions) {
    std::int64_t best_at = -1;
    math_t<T> best = 0;
    for (std::int64_t t = 0; t < s.taps; ++t) {
      const std::int64_t at = kernels::window_source(s, p, t);
      if (at < 0) continue;
      const math_t<T> v = widen(x[at]);
      if (best_at < 0 || v > best) best = v, best_at = at;
    }
    if (best_at >= 0) atomicAdd(out + best_at, g[p]);
  }
}

template <class F>
void by_type(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::i32: return f(std::int32_t{});
    case DType::bf16: return f(__nv_bfloat16{});
    case DType::f16: return f(__half{});
  }
}

template <class F>
void by_float(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(__nv_bfloat16{});
    case DType::f16: return f(__half{});
    case DType::i32: break;
  }
  user_error("gpu kernels: i32 operands are not supported for this op, convert them to a float type first");
}

}  // namespace device

namespace launch {

void unary(OpKind kind, DType t, const void* x, void* out, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  device::by_float(t, [&](auto z) {
    using T = decltype(z);
    device::unary_kernel<T><<<device::blocks_for(n), device::threads, 0, stream>>>(kind, static_cast<const T*>(x),
                                                                                   static_cast<T*>(out), n);
  });
  device::check_launch("unary_kernel");
}

void binary(OpKind kind, DType t, const void* x, const void* y, void* out, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  device::by_float(t, [&](auto z) {
    using T = decltype(z);
    device::binary_kernel<T><<<device::blocks_for(n), device::threads, 0, stream>>>(
        kind, static_cast<const T*>(x), static_cast<const T*>(y), static_cast<T*>(out), n);
  });
  device::check_launch("binary_kernel");
}

void compare(CompareDir dir, DType t, const void* x, const void* y, void* out, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  device::by_type(t, [&](auto z) {
    using T = decltype(z);
    device::compare_kernel<T><<<device::blocks_for(n), device::threads, 0, stream>>>(
        dir, static_cast<const T*>(x), static_cast<const T*>(y), static_cast<T*>(out), n);
  });
  device::check_launch("compare_kernel");
}

void select(DType mask, DType t, const void* m, const void* on_true, const void* on_false, void* out, std::int64_t n,
            cudaStream_t stream) {
  if (n == 0) return;
  device::by_type(mask, [&](auto zm) {
    device::by_type(t, [&](auto z) {
      using M = decltype(zm);
      using T = decltype(z);
      device::select_kernel<M, T><<<device::blocks_for(n), device::threads, 0, stream>>>(
          static_cast<const M*>(m), static_cast<const T*>(on_true), static_cast<const T*>(on_false), static_cast<T*>(out), n);
    });
  });
  device::check_launch("select_kernel");
}

void convert(DType from, DType to, const void* x, void* out, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  device::by_type(from, [&](auto zf) {
    device::by_type(to, [&](auto zt) {
      using F = decltype(zf);
      using T = decltype(zt);
      device::convert_kernel<F, T><<<device::blocks_for(n), device::threads, 0, stream>>>(static_cast<const F*>(x),
                                                                                          static_cast<T*>(out), n);
    });
  });
  device::check_launch("convert_kernel");
}

void fill(DType t, double value, void* out, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  device::by_type(t, [&](auto z) {
    using T = decltype(z);
    device::fill_kernel<T><<<device::blocks_for(n), device::threads, 0, stream>>>(value, static_cast<T*>(out), n);
  });
  device::check_launch("fill_kernel");
}

void strided_copy(int element_bytes, const StridedShape& s, const void* src, void* dst, cudaStream_t stream) {
  std::int64_t n = 1;
  for (int d = 0; d < s.rank; ++d) n *= s.shape[d];
  if (n == 0) return;
  if (element_bytes == 2)
    device::strided_copy_kernel<std::uint16_t><<<device::blocks_for(n), device::threads, 0, stream>>>(
        s, n, static_cast<const std::uint16_t*>(src), static_cast<std::uint16_t*>(dst));
  else if (element_bytes == 4)
    device::strided_copy_kernel<std::uint32_t><<<device::blocks_for(n), device::threads, 0, stream>>>(
        s, n, static_cast<const std::uint32_t*>(src), static_cast<std::uint32_t*>(dst));
  else
    device::strided_copy_kernel<std::uint64_t><<<device::blocks_for(n), device::threads, 0, stream>>>(
        s, n, static_cast<const std::uint64_t*>(src), static_cast<std::uint64_t*>(dst));
  device::check_launch("strided_copy_kernel");
}

void reduce(bool take_max, DType t, const ReduceShape& s, const void* x, void* out, void* scratch, cudaStream_t stream) {
  if (s.outputs == 0) return;
  const std::int64_t parts = scratch ? reduce_parts(s) : 1;
  device::by_type(t, [&](auto z) {
    using T = decltype(z);
    using A = device::math_t<T>;  // the chunks' sums in scratch: f32 for the 16-bit types
    auto pass = [&](auto in, auto result, const ReduceShape& shape, std::int64_t p, const void* from, void* to) {
      using In = decltype(in);
      using Out = decltype(result);
      if (take_max) device::reduce_pass<In, Out, true>(shape, p, static_cast<const In*>(from), static_cast<Out*>(to), stream);
      else device::reduce_pass<In, Out, false>(shape, p, static_cast<const In*>(from), static_cast<Out*>(to), stream);
    };
    if (parts == 1) {
      pass(T{}, T{}, s, 1, x, out);
    } else {  // chunks into scratch, then each output's chunks (same stream: in order)
      pass(T{}, A{}, s, parts, x, scratch);
      pass(A{}, T{}, partials_shape(s.outputs, parts), 1, scratch, out);
    }
  });
}

void gather(DType t, const void* table, const std::int32_t* indices, void* out, std::int64_t n, std::int64_t rows,
            std::int64_t row_elements, std::int64_t first_row, std::int64_t global_rows, int* bad_index,
            cudaStream_t stream) {
  if (n == 0) return;
  const std::int64_t threads = n * (row_elements > 0 ? row_elements : 1);
  device::by_type(t, [&](auto z) {
    using T = decltype(z);
    device::gather_kernel<T><<<device::blocks_for(threads), device::threads, 0, stream>>>(
        static_cast<const T*>(table), indices, static_cast<T*>(out), n, rows, row_elements, first_row, global_rows,
        bad_index);
  });
  device::check_launch("gather_kernel");
}

void scatter_add(DType t, const std::int32_t* indices, const void* updates, void* out, std::int64_t n, std::int64_t rows,
                 std::int64_t row_elements, std::int64_t first_row, std::int64_t global_rows, int* bad_index,
                 cudaStream_t stream) {
  if (n == 0) return;
  const std::int64_t threads = n * (row_elements > 0 ? row_elements : 1);
  device::by_type(t, [&](auto z) {
    using T = decltype(z);
    device::scatter_add_kernel<T><<<device::blocks_for(threads), device::threads, 0, stream>>>(
        indices, static_cast<const T*>(updates), static_cast<T*>(out), n, rows, row_elements, first_row, global_rows,
        bad_index);
  });
  device::check_launch("scatter_add_kernel");
}

void convolution(DType t, const WindowShape& s, std::int64_t images, std::int64_t in_features, std::int64_t out_features,
                 std::int64_t groups, const void* x, const void* w, void* out, cudaStream_t stream) {
  const std::int64_t n = images * s.positions * out_features;
  if (n == 0) return;
  device::by_float(t, [&](auto z) {
    using T = decltype(z);
    device::convolution_kernel<T><<<device::blocks_for(n), device::threads, 0, stream>>>(
        s, images, in_features, out_features, groups, static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(out));
  });
  device::check_launch("convolution_kernel");
}

void reduce_window(bool take_max, DType t, const WindowShape& s, const void* x, void* out, cudaStream_t stream) {
  if (s.positions == 0) return;
  device::by_float(t, [&](auto z) {
    using T = decltype(z);
    if (take_max)
      device::reduce_window_kernel<T, true><<<device::blocks_for(s.positions), device::threads, 0, stream>>>(
          s, static_cast<const T*>(x), static_cast<T*>(out));
    else
      device::reduce_window_kernel<T, false><<<device::blocks_for(s.positions), device::threads, 0, stream>>>(
          s, static_cast<const T*>(x), static_cast<T*>(out));
  });
  device::check_launch("reduce_window_kernel");
}

void select_and_scatter(DType t, const WindowShape& s, const void* x, const void* g, void* out, cudaStream_t stream) {
  if (s.positions == 0) return;
  device::by_float(t, [&](auto z) {
    using T = decltype(z);
    device::select_and_scatter_kernel<T><<<device::blocks_for(s.positions), device::threads, 0, stream>>>(
        s, static_cast<const T*>(x), static_cast<const T*>(g), static_cast<T*>(out));
  });
  device::check_launch("select_and_scatter_kernel");
}

}  // namespace launch
}  // namespace partir::gpu
