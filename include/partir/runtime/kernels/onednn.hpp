#pragma once
// oneDNN's matmul as a GEMM engine, built in when the build defines PARTIR_USE_ONEDNN (Meson -Dgemm=auto|onednn
// adds it with libdnnl and libgomp; a header-only consumer defines it and links -ldnnl -lgomp itself).
// - One primitive runs a whole batched GEMM, operands in place: batch dims, transposed and strided operands
//   are strides of the memory descriptors, never copies. oneDNN picks its kernels for the CPU at run time
//   (brgemm AVX-512 here; AVX2 or SSE elsewhere).
// - Primitives are cached per (dtype, shape, strides, threads) and per calling thread: creating one costs
//   tens of microseconds, which a step must not pay per GEMM.
// - Threads: Debian's oneDNN runs on OpenMP, whose team size is a per-thread setting. Each calling thread
//   sets its own to kernel_threads(), so N devices on the threads backend run N teams of budget / N threads
//   and never oversubscribe the cores.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "partir/ir/half.hpp"
#include "partir/runtime/kernels/kernel_threads.hpp"

#ifdef PARTIR_USE_ONEDNN
#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace partir::onednn {

// One operand of a batched GEMM: its batch dims' strides, and each matrix row- or column-major with the
// stride between its rows (row-major) or columns (column-major).
struct Operand {
  const std::vector<std::int64_t>& batch_strides;
  bool row_major = true;
  std::int64_t leading = 1;
};

// A thread's primitive cache: layouts with a primitive, and layouts oneDNN rejected (run elsewhere); matmuls
// and convolutions apart.
struct CacheStats {
  std::size_t primitives = 0, rejected = 0, convolutions = 0, rejected_convolutions = 0;
  bool operator==(const CacheStats&) const = default;
};

// A convolution in partir's layouts (ConvDims in op.hpp): x [N, in..., C] convolved with a kernel
// [window..., C / G, O] (taps reversed when flipped) into [N, out..., O]; per spatial dim a stride, an input
// (lhs) and a window (rhs) dilation and the padding before (lo) and after (hi).
struct Convolution {
  std::int64_t images = 0, in_features = 0, out_features = 0, groups = 1;
  std::vector<std::int64_t> in, window, out, strides, lhs_dilation, rhs_dilation, lo, hi;
  bool flip = false;
};

#ifdef PARTIR_USE_ONEDNN

// The element types oneDNN's matmul takes (f64 has no CPU matmul): adding a dtype is one entry. bf16
// matmuls accumulate in f32 (AVX512-BF16 here). f16 stays out: only AVX512-FP16 CPUs run it natively.
template <class T> struct DataType { static constexpr bool supported = false; };
template <dnnl::memory::data_type t> struct Supported {
  static constexpr bool supported = true;
  static constexpr auto value = t;
};
template <> struct DataType<float> : Supported<dnnl::memory::data_type::f32> {};
template <> struct DataType<bf16> : Supported<dnnl::memory::data_type::bf16> {};

namespace detail {

struct Primitive {
  dnnl::matmul matmul;
  dnnl::memory::desc a, b, c;
};

// A convolution or deconvolution (see convolution() below) and the layouts it reads and writes: the kernel is
// reordered into `weights` (oneDNN's blocked layout of choice) when that differs from partir's `user_weights`.
struct ConvPrimitive {
  dnnl::primitive primitive;
  dnnl::memory::desc src, user_weights, weights, dst;
};

struct KeyHash {
  std::size_t operator()(const std::vector<std::int64_t>& key) const {
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (auto v : key) h = (h ^ static_cast<std::uint64_t>(v)) * 1099511628211ull;
    return static_cast<std::size_t>(h);
  }
};

// Engine, stream and primitives of one calling thread (members destroyed in reverse: primitives first).
struct ThreadContext {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::unordered_map<std::vector<std::int64_t>, std::optional<Primitive>, KeyHash> primitives;  // nullopt: unsupported
  std::unordered_map<std::vector<std::int64_t>, std::optional<ConvPrimitive>, KeyHash> convolutions;
};

inline ThreadContext& context() {
  thread_local ThreadContext ctx;
  return ctx;
}

template <class T>
std::optional<Primitive> create(dnnl::engine& engine, const dnnl::memory::dims& a_dims, const dnnl::memory::dims& a_strides,
                                const dnnl::memory::dims& b_dims, const dnnl::memory::dims& b_strides,
                                const dnnl::memory::dims& c_dims, const dnnl::memory::dims& c_strides) {
  try {
    constexpr auto t = DataType<T>::value;
    Primitive p{{}, {a_dims, t, a_strides}, {b_dims, t, b_strides}, {c_dims, t, c_strides}};
#if DNNL_VERSION_MAJOR >= 3
    p.matmul = dnnl::matmul(dnnl::matmul::primitive_desc(engine, p.a, p.b, p.c));
#else
    p.matmul = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(p.a, p.b, p.c), engine));
#endif
    return p;
  } catch (const dnnl::error&) {
    return std::nullopt;  // a layout oneDNN rejects: the caller falls back to another engine
  }
}

// The layouts partir keeps: activations [N, spatial..., features] (oneDNN's dims [N, features, spatial...]
// with those strides) and the kernel [window..., C / G, O] (dims [G, O / G, C / G, window...], or [O, C, window...]).
inline dnnl::memory::desc activations(dnnl::memory::data_type t, std::int64_t images, std::int64_t features,
                                      const std::vector<std::int64_t>& sizes) {
  dnnl::memory::dims dims{images, features}, strides{0, 1};
  dims.insert(dims.end(), sizes.begin(), sizes.end());
  strides.resize(dims.size());
  std::int64_t stride = features;
  for (std::size_t i = sizes.size(); i-- > 0;) strides[i + 2] = stride, stride *= sizes[i];
  strides[0] = stride;
  return {dims, t, strides};
}
inline std::pair<dnnl::memory::dims, dnnl::memory::dims> kernel_layout(const Convolution& c) {
  const std::int64_t G = c.groups, Cg = c.in_features / G, O = c.out_features, Og = O / G;
  dnnl::memory::dims dims = G > 1 ? dnnl::memory::dims{G, Og, Cg} : dnnl::memory::dims{O, Cg};
  dnnl::memory::dims strides = G > 1 ? dnnl::memory::dims{Og, 1, O} : dnnl::memory::dims{1, O};
  const std::size_t first = strides.size();
  dims.insert(dims.end(), c.window.begin(), c.window.end());
  strides.resize(dims.size());
  std::int64_t stride = Cg * O;
  for (std::size_t i = c.window.size(); i-- > 0;) strides[first + i] = stride, stride *= c.window[i];
  return {dims, strides};
}

// A Primitive (convolution_forward or deconvolution_forward) on p's activations, the kernel's layout left to oneDNN.
template <class Primitive>
void make_forward(ConvPrimitive& p, dnnl::engine& engine, dnnl::algorithm algorithm,
                  const dnnl::memory::desc& any_kernel, const dnnl::memory::dims& strides,
                  const dnnl::memory::dims& dilation, const dnnl::memory::dims& pl, const dnnl::memory::dims& pr) {
#if DNNL_VERSION_MAJOR >= 3
  const typename Primitive::primitive_desc pd(engine, dnnl::prop_kind::forward_inference, algorithm, p.src, any_kernel,
                                              p.dst, strides, dilation, pl, pr);
#else
  const typename Primitive::primitive_desc pd(
      {dnnl::prop_kind::forward_inference, algorithm, p.src, any_kernel, p.dst, strides, dilation, pl, pr}, engine);
#endif
  p.weights = pd.weights_desc();
  p.primitive = Primitive(pd);
}

// A flipped kernel is a deconvolution's (the input gradient of a convolution: oneDNN's backward data as a
// forward primitive): output position p reads input position i through tap k where p = i s + k d - pl, s
// the input dilation; reversing the taps of `convolution`'s definition gives pl = (K - 1) d - lo, pr likewise.
template <class T>
std::optional<ConvPrimitive> create_convolution(dnnl::engine& engine, const Convolution& c) {
  using dims = dnnl::memory::dims;
  constexpr auto t = DataType<T>::value;
  try {
    const auto [kernel_dims, kernel_strides] = kernel_layout(c);
    ConvPrimitive p{{}, activations(t, c.images, c.in_features, c.in), {kernel_dims, t, kernel_strides}, {},
                    activations(t, c.images, c.out_features, c.out)};
    const dnnl::memory::desc any_kernel{kernel_dims, t, dnnl::memory::format_tag::any};
    dims strides = c.flip ? c.lhs_dilation : c.strides, dilation, pl = c.lo, pr = c.hi;
    for (std::size_t i = 0; i < c.window.size(); ++i) {
      dilation.push_back(c.rhs_dilation[i] - 1);  // oneDNN counts the holes between taps
      if (c.flip) {
        pl[i] = (c.window[i] - 1) * c.rhs_dilation[i] - c.lo[i];
        pr[i] = (c.window[i] - 1) * c.rhs_dilation[i] - c.hi[i];
      }
    }
    if (c.flip)
      make_forward<dnnl::deconvolution_forward>(p, engine, dnnl::algorithm::deconvolution_direct, any_kernel, strides,
                                                dilation, pl, pr);
    else
      make_forward<dnnl::convolution_forward>(p, engine, dnnl::algorithm::convolution_direct, any_kernel, strides,
                                              dilation, pl, pr);
    return p;
  } catch (const dnnl::error&) {
    return std::nullopt;  // e.g. negative padding: the caller computes it another way
  }
}

}  // namespace detail

// OpenMP threads a oneDNN primitive called from this thread runs on now.
inline int team_size() { return omp_get_max_threads(); }

// This thread's.
inline CacheStats cache_stats() {
  CacheStats s;
  for (const auto& [key, p] : detail::context().primitives) ++(p ? s.primitives : s.rejected);
  for (const auto& [key, p] : detail::context().convolutions) ++(p ? s.convolutions : s.rejected_convolutions);
  return s;
}
// Frees this thread's primitives (they are made again on use).
inline void clear_cache() {
  detail::context().primitives.clear();
  detail::context().convolutions.clear();
}

inline constexpr std::size_t max_cached_primitives = 4096;

// C[batch..., m, n] = A[batch..., m, k] B[batch..., k, n], C dense row-major. Returns false when this build
// has no oneDNN or oneDNN has no matmul for T or this layout; the caller then uses another engine.
template <class T>
bool matmul(const std::vector<std::int64_t>& batch, const Operand& a, const Operand& b, std::int64_t m, std::int64_t n,
            std::int64_t k, const T* a_data, const T* b_data, T* c_data) {
  if constexpr (!DataType<T>::supported) {
    return false;
  } else {
    const std::size_t nd = batch.size() + 2;
    if (nd > DNNL_MAX_NDIMS || m <= 0 || n <= 0 || k <= 0) return false;
    const int threads = kernel_threads();
    if (omp_get_max_threads() != threads) omp_set_num_threads(threads);

    dnnl::memory::dims a_dims(batch.begin(), batch.end()), b_dims = a_dims, c_dims = a_dims;
    dnnl::memory::dims a_strides(a.batch_strides.begin(), a.batch_strides.end());
    dnnl::memory::dims b_strides(b.batch_strides.begin(), b.batch_strides.end()), c_strides(nd, 1);
    a_dims.insert(a_dims.end(), {m, k});
    b_dims.insert(b_dims.end(), {k, n});
    c_dims.insert(c_dims.end(), {m, n});
    a_strides.insert(a_strides.end(), {a.row_major ? a.leading : 1, a.row_major ? 1 : a.leading});
    b_strides.insert(b_strides.end(), {b.row_major ? b.leading : 1, b.row_major ? 1 : b.leading});
    for (std::size_t d = nd - 1; d-- > 0;) c_strides[d] = c_strides[d + 1] * c_dims[d + 1];

    std::vector<std::int64_t> key{static_cast<std::int64_t>(DataType<T>::value), threads};
    for (const auto* part : {&a_dims, &a_strides, &b_dims, &b_strides}) key.insert(key.end(), part->begin(), part->end());
    auto& ctx = detail::context();
    auto it = ctx.primitives.find(key);
    if (it == ctx.primitives.end()) {
      if (ctx.primitives.size() >= max_cached_primitives) ctx.primitives.clear();  // a program's shapes are few
      it = ctx.primitives.emplace(key, detail::create<T>(ctx.engine, a_dims, a_strides, b_dims, b_strides, c_dims, c_strides))
               .first;
    }
    if (!it->second) return false;
    const detail::Primitive& p = *it->second;
    dnnl::memory am(p.a, ctx.engine, const_cast<T*>(a_data)), bm(p.b, ctx.engine, const_cast<T*>(b_data));
    dnnl::memory cm(p.c, ctx.engine, c_data);
    p.matmul.execute(ctx.stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    ctx.stream.wait();
    return true;
  }
}

// The convolution `c` by oneDNN's convolution primitives (the kernel reordered into the layout the primitive
// chose, activations in place). Returns false when this build has no oneDNN, oneDNN has no primitive for T or
// this geometry, or it is neither a convolution (no input dilation) nor a deconvolution (flipped, stride 1).
template <class T>
bool convolution(const Convolution& c, const T* x, const T* w, T* out) {
  if constexpr (!DataType<T>::supported) {
    return false;
  } else {
    auto all_ones = [](const std::vector<std::int64_t>& v) {
      return std::all_of(v.begin(), v.end(), [](auto e) { return e == 1; });
    };
    if (c.in.empty() || c.in.size() > 3 || !all_ones(c.flip ? c.strides : c.lhs_dilation)) return false;
    const int threads = kernel_threads();
    if (omp_get_max_threads() != threads) omp_set_num_threads(threads);
    std::vector<std::int64_t> key{static_cast<std::int64_t>(DataType<T>::value), threads, c.flip, c.images,
                                  c.in_features, c.out_features, c.groups};
    for (const auto* part : {&c.in, &c.window, &c.out, &c.strides, &c.lhs_dilation, &c.rhs_dilation, &c.lo, &c.hi})
      key.insert(key.end(), part->begin(), part->end());
    auto& ctx = detail::context();
    auto it = ctx.convolutions.find(key);
    if (it == ctx.convolutions.end()) {
      if (ctx.convolutions.size() >= max_cached_primitives) ctx.convolutions.clear();
      it = ctx.convolutions.emplace(key, detail::create_convolution<T>(ctx.engine, c)).first;
    }
    if (!it->second) return false;
    const detail::ConvPrimitive& p = *it->second;
    dnnl::memory xm(p.src, ctx.engine, const_cast<T*>(x)), wm(p.user_weights, ctx.engine, const_cast<T*>(w));
    dnnl::memory om(p.dst, ctx.engine, out);
    if (p.weights != p.user_weights) {
      dnnl::memory reordered(p.weights, ctx.engine);
      dnnl::reorder(wm, reordered).execute(ctx.stream, wm, reordered);
      wm = reordered;
    }
    p.primitive.execute(ctx.stream, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, om}});
    ctx.stream.wait();
    return true;
  }
}

#else

inline int team_size() { return 0; }
inline CacheStats cache_stats() { return {}; }
inline void clear_cache() {}
template <class T>
bool matmul(const std::vector<std::int64_t>&, const Operand&, const Operand&, std::int64_t, std::int64_t, std::int64_t,
            const T*, const T*, T*) {
  return false;
}
template <class T>
bool convolution(const Convolution&, const T*, const T*, T*) {
  return false;
}

#endif

}  // namespace partir::onednn
