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

// A thread's primitive cache: layouts with a primitive, and layouts oneDNN rejected (run elsewhere).
struct CacheStats {
  std::size_t primitives = 0, rejected = 0;
  bool operator==(const CacheStats&) const = default;
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

}  // namespace detail

// OpenMP threads a oneDNN primitive called from this thread runs on now.
inline int team_size() { return omp_get_max_threads(); }

// This thread's.
inline CacheStats cache_stats() {
  CacheStats s;
  for (const auto& [key, p] : detail::context().primitives) ++(p ? s.primitives : s.rejected);
  return s;
}
// Frees this thread's primitives (they are made again on use).
inline void clear_cache() { detail::context().primitives.clear(); }

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

#else

inline int team_size() { return 0; }
inline CacheStats cache_stats() { return {}; }
inline void clear_cache() {}
template <class T>
bool matmul(const std::vector<std::int64_t>&, const Operand&, const Operand&, std::int64_t, std::int64_t, std::int64_t,
            const T*, const T*, T*) {
  return false;
}

#endif

}  // namespace partir::onednn
