// The GPU backend. Two suites in one program:
//   test_gpu --host   runs everywhere: the device pool and its liveness plan, and the no-GPU diagnostics;
//   test_gpu          compares every GPU kernel with the Eigen kernel and a train step with interpret();
//                     without a CUDA device it says so and exits 77 (Meson: SKIP).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <partir/partir.hpp>
#include <partir/runtime/gpu/executor.hpp>
#include <partir/calibrate/gpu_profile.hpp>

#include <cmath>
#include <cstring>
#include <iostream>
#include <random>

using namespace partir;

namespace {

using Rng = std::mt19937_64;

Array random_array(Rng& rng, const TensorType& t, double lo = -2, double hi = 2) {
  Array a(t);
  std::uniform_real_distribution<double> u(lo, hi);
  for (std::int64_t i = 0; i < a.size(); ++i) a.set(i, t.dtype == DType::i32 ? std::round(u(rng)) : u(rng));
  return a;
}

// Max |got - want| / (1 + |want|); NaN where one is NaN and the other not.
double error(const Array& got, const Array& want) {
  REQUIRE(to_string(got.type()) == to_string(want.type()));
  double worst = 0;
  for (std::int64_t i = 0; i < want.size(); ++i) {
    const double g = got.at(i), w = want.at(i);
    if (std::isnan(w) || std::isnan(g)) {
      if (std::isnan(w) != std::isnan(g)) return NAN;
      continue;
    }
    if (std::isinf(w) || std::isinf(g)) {
      if (g != w) return INFINITY;
      continue;
    }
    worst = std::max(worst, std::abs(g - w) / (1 + std::abs(w)));
  }
  return worst;
}

// Relative to 1 + |want|. The 16-bit types compute in f32 on both sides and round once, so results differ by
// at most one unit in the last place where f32 math (exp, tanh, ...) or summation order differs by a bit:
// 2^-8 for bf16 (8 significant bits), 2^-11 for f16; the bounds leave twice that.
double tolerance(DType t) {
  switch (t) {
    case DType::f32: return 1e-5;
    case DType::f64: return 1e-12;
    case DType::bf16: return 1e-2;
    case DType::f16: return 2e-3;
    case DType::i32: return 0;
  }
  return 0;
}

// A one-op program on the given operands.
Program one_op(OpKind kind, const std::vector<Array>& args, const Attrs& attrs, NamedArrays& inputs) {
  Program p("t");
  std::vector<ValueId> ids;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string name = "a" + std::to_string(i);
    ids.push_back(p.add_input(name, args[i].type()));
    inputs.emplace(name, args[i]);
  }
  p.add_output("y", p.add(kind, ids, attrs));
  return p;
}

SpmdProgram on_one_device(const Program& p) { return lower(partition(p, Mesh{{"d", 1}}, Schedule{})); }

nccl::Communicator& gpu_comm() {
  static nccl::Communicator comm;
  return comm;
}

// The op on the GPU and on the Eigen kernels (through interpret): the relative error.
double gpu_vs_cpu(OpKind kind, const std::vector<Array>& args, const Attrs& attrs = {}) {
  NamedArrays inputs;
  const Program p = one_op(kind, args, attrs, inputs);
  const Array want = interpret(p, inputs).at("y");
  const Array got = gpu::execute(on_one_device(p), gpu_comm(), inputs).outputs.at("y");
  return error(got, want);
}

std::string describe(OpKind kind, const std::vector<Array>& args) {
  std::string s(name_of(kind));
  for (const auto& a : args) s += " " + to_string(a.type());
  return s;
}

// What launch::strided_copy does, on the host, with the kernel's index function.
void apply_view(const gpu::View& v, const Array& src, Array& dst) {
  const gpu::StridedShape s = gpu::strided(v);
  std::int64_t n = 1;
  for (int d = 0; d < s.rank; ++d) n *= s.shape[d];
  if (num_elements(v.shape) == 0) n = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t from = 0, to = 0;
    gpu::view_offsets(s, i, from, to);
    dst.set(v.dst_offset + to, src.at(v.src_offset + from));
  }
}

// Device copies for the tests that launch kernels directly (synchronous copies on the default stream).
template <class T>
T* to_device(const std::vector<T>& v) {
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, std::max<std::size_t>(v.size(), 1) * sizeof(T)) == cudaSuccess);
  if (!v.empty()) REQUIRE(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  return static_cast<T*>(p);
}
template <class T>
std::vector<T> to_host(const T* p, std::size_t n) {
  std::vector<T> v(n);
  REQUIRE(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
  return v;
}

struct DotCase {
  Shape lhs, rhs;
  DotDims dims;
};
std::vector<DotCase> dot_cases() {
  return {
      {{64, 32}, {32, 48}, {{}, {}, {1}, {0}}},                  // plain
      {{32, 64}, {32, 48}, {{}, {}, {0}, {0}}},                  // lhs transposed
      {{64, 32}, {48, 32}, {{}, {}, {1}, {1}}},                  // rhs transposed (x W^T)
      {{4, 16, 8}, {4, 8, 12}, {{0}, {0}, {2}, {1}}},            // batched
      {{16, 4, 8}, {4, 8, 12}, {{1}, {0}, {2}, {1}}},            // batch dim in the middle
      {{2, 3, 5, 6}, {3, 2, 6, 7}, {{0, 1}, {1, 0}, {3}, {2}}},  // two batch dims, permuted
      {{8, 4, 6}, {4, 6, 5}, {{}, {}, {1, 2}, {0, 1}}},          // two contracting dims
      {{8, 4, 6}, {6, 4, 5}, {{}, {}, {1, 2}, {1, 0}}},          // contracting dims paired out of order
      {{1, 5}, {5, 1}, {{}, {}, {1}, {0}}},                      // degenerate
      {{5}, {5, 3}, {{}, {}, {0}, {0}}},                         // vector x matrix
      {{2, 4, 1, 3}, {2, 3, 6}, {{0}, {0}, {3}, {1}}},           // unit dim among the free dims
      {{3, 4, 2, 5}, {3, 5, 2, 6}, {{0, 2}, {0, 2}, {3}, {1}}},  // attention-like: heads between
  };
}

// Windowed ops: convolutions (strides, padding negative too, both dilations, flipped, feature groups) and
// poolings (strided, padded, base- and window-dilated), with their operand shapes.
struct WindowCase {
  OpKind kind;
  Shape x, w;  // w: a convolution's kernel, else the window's result (select_and_scatter's g)
  Attrs attrs;
};
std::vector<WindowCase> window_cases() {
  auto conv = [](Shape x, Shape w, ConvDims c, std::vector<std::int64_t> lo, std::vector<std::int64_t> hi) {
    Attrs a;
    a.conv = std::move(c), a.lo = std::move(lo), a.hi = std::move(hi);
    return WindowCase{OpKind::convolution, std::move(x), std::move(w), a};
  };
  auto pool = [](OpKind kind, Shape x, WindowDims w, std::vector<std::int64_t> lo, std::vector<std::int64_t> hi) {
    Attrs a;
    a.window = std::move(w), a.lo = std::move(lo), a.hi = std::move(hi);
    return WindowCase{kind, std::move(x), {}, a};
  };
  std::vector<WindowCase> cases{
      conv({2, 5, 6, 3}, {3, 2, 3, 4}, {{2, 1}, {1, 1}, {1, 2}}, {1, 0}, {1, 2}),
      conv({3, 7, 2}, {2, 2, 5}, {{3}, {1}, {1}}, {2}, {0}),
      conv({1, 4, 4, 2}, {2, 2, 2, 3}, {{1, 2}, {2, 3}, {1, 1}, true}, {1, 0}, {-1, 2}),
      conv({2, 5, 4, 6}, {3, 2, 2, 9}, {{2, 1}, {1, 1}, {1, 1}, false, 3}, {1, 0}, {1, 1}),
      conv({1, 6, 5, 4}, {3, 3, 1, 8}, {{1, 1}, {1, 2}, {2, 1}, true, 4}, {2, 1}, {2, -1}),
      conv({2, 4, 3, 3, 2}, {2, 2, 2, 2, 3}, {{1, 2, 1}, {1, 1, 1}, {1, 1, 2}}, {1, 0, 1}, {0, 1, 1}),
  };
  for (OpKind kind : {OpKind::reduce_window_sum, OpKind::reduce_window_max, OpKind::select_and_scatter}) {
    cases.push_back(pool(kind, {2, 6, 5, 3}, {{1, 3, 2, 1}, {1, 2, 1, 1}, {1, 1, 1, 1}, {1, 1, 2, 1}}, {0, 1, 0, 0}, {0, 1, 1, 0}));
    cases.push_back(pool(kind, {4, 8, 8, 2}, {{1, 2, 2, 1}, {1, 2, 2, 1}, {1, 1, 1, 1}, {1, 1, 1, 1}}, {0, 0, 0, 0}, {0, 0, 0, 0}));
    if (kind != OpKind::select_and_scatter)  // base dilation: pooling only (its gradient is refused)
      cases.push_back(pool(kind, {3, 7}, {{2, 3}, {1, 2}, {2, 1}, {1, 1}}, {-1, 1}, {0, 2}));
  }
  return cases;
}
// The operands of a window case: x, then the kernel or (select_and_scatter) one value per window.
std::vector<Array> window_operands(Rng& rng, const WindowCase& c, DType t) {
  std::vector<Array> args{random_array(rng, {c.x, t})};
  if (c.kind == OpKind::convolution) {
    args.push_back(random_array(rng, {c.w, t}));
  } else if (c.kind == OpKind::select_and_scatter) {
    NamedArrays inputs;
    const Program p = one_op(OpKind::reduce_window_max, args, c.attrs, inputs);
    args.push_back(random_array(rng, p.type(p.outputs().at(0).value)));
  }
  return args;
}

#define CHECK_GPU_OP(kind, args, ...)                                     \
  do {                                                                    \
    INFO(describe(kind, args));                                           \
    CHECK(gpu_vs_cpu(kind, args, ##__VA_ARGS__) <= tolerance(args[0].dtype())); \
  } while (0)

}  // namespace

// ---------------------------------------------------------------- host suite: runs without a GPU

TEST_SUITE("host") {
  TEST_CASE("datasheet profile by device name: H200, H100 and A100 by model, any other GPU as detect()") {
    CHECK(gpu::datasheet_profile(std::string("NVIDIA H200")).name == "h200-nvlink");
    CHECK(gpu::datasheet_profile(std::string("NVIDIA H100 80GB HBM3")).name == "h100-nvlink");
    CHECK(gpu::datasheet_profile(std::string("NVIDIA A100-SXM4-80GB")).name == "a100-nvlink");
    CHECK(gpu::datasheet_profile(std::string("Tesla T4")) == HardwareProfile::detect());
  }

  TEST_CASE("size classes: exact below 1 MiB in 512-byte steps, at most 12.5% over above") {
    CHECK(gpu::size_class(1) == 512);
    CHECK(gpu::size_class(513) == 1024);
    CHECK(gpu::size_class((1 << 20) - 1) == (1 << 20));
    for (std::int64_t b : {std::int64_t{1} << 20, (std::int64_t{3} << 20) + 7, std::int64_t{1} << 30, std::int64_t{123456789}}) {
      CHECK(gpu::size_class(b) >= b);
      CHECK(static_cast<double>(gpu::size_class(b)) <= 1.125 * static_cast<double>(b));
    }
  }

  TEST_CASE("device pool: freed blocks are reused by size class; release gives the cache back") {
    gpu::BasicPool<gpu::CountingAllocator> pool;
    void* a = pool.take(1000);
    void* b = pool.take(4096);
    CHECK(pool.allocations() == 2);
    pool.give(a, 1000);
    CHECK(pool.take(1024) == a);  // same class (1024): reused
    CHECK(pool.allocations() == 2);
    pool.give(b, 4096);
    pool.give(a, 1024);
    CHECK(pool.bytes_in_use() == 0);
    CHECK(pool.bytes_cached() == 1024 + 4096);
    pool.release();
    CHECK(pool.bytes_cached() == 0);
    CHECK(pool.bytes_held() == 0);
  }

  TEST_CASE("device pool: out of memory names the request and what is in use") {
    gpu::CountingAllocator limited;
    limited.limit = 4096;
    gpu::BasicPool<gpu::CountingAllocator> pool(limited);
    (void)pool.take(4000);
    CHECK_THROWS_WITH_AS(pool.take(512), doctest::Contains("out of device memory: a buffer of 512 bytes"), UserError);
  }

  TEST_CASE("device pool: reserve allocates only the blocks the cache lacks") {
    gpu::BasicPool<gpu::CountingAllocator> pool;
    pool.reserve({1000, 1000, 5000});
    CHECK(pool.allocations() == 3);
    pool.reserve({1024, 5000});
    CHECK(pool.allocations() == 3);
    void* x = pool.take(1000);
    void* y = pool.take(1000);
    CHECK(x != y);
    CHECK(pool.allocations() == 3);
  }

  TEST_CASE("liveness plan: a chain of ops needs two result blocks, not one per op") {
    Program p("chain");
    ValueId v = p.add_input("x", {{1024, 1024}, DType::f32});
    for (int i = 0; i < 6; ++i) v = p.add(OpKind::neg, {v});
    p.add_output("y", v);
    const gpu::PoolPlan plan = gpu::plan_pool(on_one_device(p));
    CHECK(plan.blocks.size() == 3);  // the input, and two results alternating
    CHECK(plan.bytes == 3 * gpu::size_class(4 << 20));
    CHECK(plan.peak_in_use == plan.bytes);
  }

  TEST_CASE("liveness plan of an MLP train step: inputs plus activations, blocks reused across ops") {
    nn::Mlp model{"params/mlp", {64, 256, 64}};
    auto loss = [&](Tensor x, Tensor y) { return mse(model(x), y); };
    const Program step = train_step(loss, Adam{1e-3}, {{"x", {32, 64}}, {"y", {32, 64}}});
    const SpmdProgram spmd = on_one_device(step);
    const gpu::PoolPlan plan = gpu::plan_pool(spmd);
    std::int64_t inputs = 0;
    for (const auto& b : spmd.inputs()) inputs += gpu::size_class(spmd.type(b.value).bytes());
    CHECK(plan.peak_in_use >= inputs);
    CHECK(plan.bytes >= plan.peak_in_use);
    CHECK(static_cast<std::int64_t>(plan.blocks.size()) < spmd.size());
  }

  // The views the executor launches, run on the host through the kernels' own index functions.
  TEST_CASE("views: broadcast, transpose, slice, pad and concatenate equal the CPU kernels") {
    Rng rng(11);
    for (int trial = 0; trial < 20; ++trial) {
      const Array y = random_array(rng, {{2 + trial % 3, 5, 3 + trial % 4}, DType::f64});
      const Shape& ys = y.shape();
      auto check = [&](OpKind kind, const std::vector<Array>& args, const Attrs& a, auto make_views) {
        NamedArrays inputs;
        const Program p = one_op(kind, args, a, inputs);
        const Array want = interpret(p, inputs).at("y");
        Array got(want.type());  // zeros: what pad's memset leaves
        make_views(got);
        INFO(name_of(kind) << " of " << to_string(ys));
        CHECK(got == want);
      };
      Attrs b;
      b.dims = {0, 2, 3};
      b.shape = {ys[0], 4, ys[1], ys[2]};
      check(OpKind::broadcast_in_dim, {y}, b, [&](Array& got) { apply_view(gpu::broadcast_view(ys, b), y, got); });
      Attrs one;
      one.dims = {0, 1, 2};
      one.shape = {ys[0], 5, ys[2]};
      const Array z = random_array(rng, {{ys[0], 1, ys[2]}, DType::f64});
      check(OpKind::broadcast_in_dim, {z}, one, [&](Array& got) { apply_view(gpu::broadcast_view(z.shape(), one), z, got); });
      for (const std::vector<std::int64_t>& perm : {std::vector<std::int64_t>{2, 1, 0}, {0, 2, 1}, {1, 2, 0}}) {
        Attrs t;
        t.dims = perm;
        const Shape out{ys[perm[0]], ys[perm[1]], ys[perm[2]]};
        check(OpKind::transpose, {y}, t, [&](Array& got) { apply_view(gpu::transpose_view(ys, t, out), y, got); });
      }
      Attrs sl;
      sl.lo = {1, 2, 0};
      sl.hi = {ys[0], 5, 2};
      check(OpKind::slice, {y}, sl, [&](Array& got) { apply_view(gpu::slice_view(ys, sl, got.shape()), y, got); });
      Attrs pad;
      pad.lo = {0, 2, 1};
      pad.hi = {1, 0, 3};
      check(OpKind::pad, {y}, pad, [&](Array& got) { apply_view(gpu::pad_view(ys, pad, got.shape()), y, got); });
      Attrs c;
      c.axis = 2;
      const Array w = random_array(rng, {{ys[0], 5, 4}, DType::f64});
      check(OpKind::concatenate, {y, w}, c, [&](Array& got) {
        apply_view(gpu::concatenate_view(ys, 2, 0, got.shape()), y, got);
        apply_view(gpu::concatenate_view(w.shape(), 2, ys[2], got.shape()), w, got);
      });
    }
  }

  TEST_CASE("views: the collectives' tiles equal layout::tile, pack and unpack") {
    Rng rng(12);
    const Array x = random_array(rng, {{4, 6, 8}, DType::f32});
    for (std::int64_t dim : {0, 1, 2})
      for (std::int64_t tiles : {1, 2}) {
        INFO("dim " << dim << ", " << tiles << " tiles");
        for (std::int64_t q = 0; q < tiles; ++q) {
          const Array want = layout::tile(x, dim, tiles, q);
          Array got(want.type());
          apply_view(gpu::tile_view(x.shape(), dim, tiles, q), x, got);
          CHECK(got == want);
        }
        Array packed(x.type()), back(x.type());
        std::vector<std::byte> want(static_cast<std::size_t>(x.bytes()));
        layout::pack(x, dim, tiles, want.data());
        apply_view(gpu::tiles_view(x.shape(), dim, tiles, true), x, packed);
        CHECK(std::memcmp(layout::bytes(packed), want.data(), want.size()) == 0);
        apply_view(gpu::tiles_view(x.shape(), dim, tiles, false), packed, back);
        CHECK(back == x);
        CHECK(gpu::tiles_are_blocks(x.shape(), dim) == (dim == 0));
      }
  }

  TEST_CASE("views: reductions over every dim subset equal reduce_sum and reduce_max") {
    Rng rng(13);
    const Array x = random_array(rng, {{3, 1, 4, 5}, DType::f64});
    for (int mask = 0; mask < 16; ++mask) {
      std::vector<std::int64_t> dims;
      for (std::int64_t d = 0; d < 4; ++d)
        if (mask & (1 << d)) dims.push_back(d);
      for (OpKind kind : {OpKind::reduce_sum, OpKind::reduce_max}) {
        Attrs a;
        a.dims = dims;
        NamedArrays inputs;
        const Array want = interpret(one_op(kind, {x}, a, inputs), inputs).at("y");
        const gpu::ReduceShape s = gpu::reduce_shape(x.shape(), dims, kind);
        REQUIRE(s.outputs == want.size());
        Array got(want.type());
        for (std::int64_t o = 0; o < s.outputs; ++o) {
          double acc = kind == OpKind::reduce_max ? -INFINITY : 0;
          for (std::int64_t j = 0; j < s.count; ++j) {
            const double v = x.at(gpu::kept_offset(s, o) + gpu::reduced_offset(s, j));
            acc = kind == OpKind::reduce_max ? std::max(acc, v) : acc + v;
          }
          got.set(o, acc);
        }
        INFO(name_of(kind) << " over " << dims.size() << " dims (mask " << mask << ")");
        CHECK(error(got, want) <= 1e-12);
      }
    }
  }

  TEST_CASE("views: reductions to few outputs over many elements, split into chunks and combined, equal the CPU") {
    Rng rng(15);
    struct Case {
      Shape shape;
      std::vector<std::int64_t> dims;
    };
    for (const auto& c : {Case{{3, 40000}, {1}}, Case{{50000}, {0}}, Case{{2, 20000, 3}, {1}}, Case{{7, 3, 9000}, {0, 2}}}) {
      const Array x = random_array(rng, {c.shape, DType::f64});
      for (OpKind kind : {OpKind::reduce_sum, OpKind::reduce_max}) {
        const bool take_max = kind == OpKind::reduce_max;
        Attrs a;
        a.dims = c.dims;
        NamedArrays inputs;
        const Array want = interpret(one_op(kind, {x}, a, inputs), inputs).at("y");
        const gpu::ReduceShape s = gpu::reduce_shape(x.shape(), c.dims, kind);
        const std::int64_t parts = gpu::reduce_parts(s);
        INFO(name_of(kind) << " of " << to_string(x.type()) << " in " << parts << " parts");
        REQUIRE(parts > 1);
        // The kernel's two passes, block by block, with its own chunk and index functions.
        auto pass = [&](const gpu::ReduceShape& shape, std::int64_t p, auto&& read, std::vector<double>& out) {
          out.assign(static_cast<std::size_t>(shape.outputs * p), 0);
          for (std::int64_t b = 0; b < shape.outputs * p; ++b) {
            std::int64_t o = 0, first = 0, last = 0;
            gpu::reduce_chunk(shape, p, b, o, first, last);
            double acc = take_max ? -INFINITY : 0;
            for (std::int64_t j = first; j < last; ++j) {
              const double v = read(gpu::kept_offset(shape, o) + gpu::reduced_offset(shape, j));
              acc = take_max ? std::max(acc, v) : acc + v;
            }
            out[static_cast<std::size_t>(b)] = acc;
          }
        };
        std::vector<double> partials, result;
        pass(s, parts, [&](std::int64_t i) { return x.at(i); }, partials);
        pass(gpu::partials_shape(s.outputs, parts), 1, [&](std::int64_t i) { return partials[static_cast<std::size_t>(i)]; },
             result);
        REQUIRE(static_cast<std::int64_t>(result.size()) == want.size());
        Array got(want.type());
        for (std::int64_t o = 0; o < want.size(); ++o) got.set(o, result[static_cast<std::size_t>(o)]);
        CHECK(error(got, want) <= 1e-12);
      }
    }
  }

  TEST_CASE("views: gather and scatter_add on row-tiled tables, through the kernels' index function, equal the CPU") {
    // Tables of 1 to 4 shards of rows, as the executor's row_shard path launches them: the gathers of all
    // shards add up to the whole gather (rows a shard lacks give zeros), the scatter_adds of all shards
    // tile the whole one, and an index outside [0, global rows) is flagged on every shard.
    Rng rng(16);
    const std::int64_t global = 12, row = 3;
    const Array table = random_array(rng, {{global, row}, DType::f64});
    const std::vector<std::int32_t> idx{0, 5, 7, 11, 4, 5, 3, 11, 0, 8};
    const auto n = static_cast<std::int64_t>(idx.size());
    const Array indices({2, 5}, idx);
    const Array updates = random_array(rng, {{2, 5, row}, DType::f64});
    NamedArrays gather_in, scatter_in;
    const Array want_rows = interpret(one_op(OpKind::gather, {table, indices}, {}, gather_in), gather_in).at("y");
    Attrs a;
    a.shape = {global, row};
    const Array want_sum = interpret(one_op(OpKind::scatter_add, {indices, updates}, a, scatter_in), scatter_in).at("y");
    for (std::int64_t shards : {1, 2, 3, 4}) {
      INFO(shards << " shards");
      const std::int64_t rows = global / shards;
      Array got_rows(want_rows.type()), got_sum(want_sum.type());
      int bad = 0;
      for (std::int64_t first = 0; first < global; first += rows)
        for (std::int64_t k = 0; k < n * row; ++k) {  // the kernels' threads, in order
          const std::int64_t at = gpu::table_offset(idx.data(), k, row, rows, first, global, &bad);
          if (at < 0) continue;
          got_rows.set(k, got_rows.at(k) + table.at(first * row + at));
          got_sum.set(first * row + at, got_sum.at(first * row + at) + updates.at(k));
        }
      CHECK(bad == 0);
      CHECK(error(got_rows, want_rows) <= 1e-12);
      CHECK(error(got_sum, want_sum) <= 1e-12);
      for (std::int32_t outside : {12, -1})
        for (std::int64_t width : {row, std::int64_t{0}}) {  // rows without elements still check their index
          INFO("index " << outside << ", rows of " << width);
          const std::vector<std::int32_t> bad_idx{5, outside};
          for (std::int64_t first = 0; first < global; first += rows) {
            bad = 0;
            for (std::int64_t k = 0; k < 2 * std::max<std::int64_t>(width, 1); ++k)
              gpu::table_offset(bad_idx.data(), k, width, rows, first, global, &bad);
            CHECK(bad == 1);
          }
        }
    }
  }

  TEST_CASE("views: convolutions and poolings through the kernels' window function equal the CPU kernels") {
    Rng rng(17);
    for (const WindowCase& c : window_cases()) {
      const std::vector<Array> args = window_operands(rng, c, DType::f64);
      INFO(describe(c.kind, args));
      NamedArrays inputs;
      const Array want = interpret(one_op(c.kind, args, c.attrs, inputs), inputs).at("y");
      Array got(want.type());
      const Array& x = args[0];
      if (c.kind == OpKind::convolution) {  // the kernel's threads: one per output element [n, p, o]
        const kernels::WindowShape s = kernels::convolution_shape(x.shape(), c.w, want.shape(), c.attrs);
        const std::int64_t C = x.shape().back(), O = c.w.back(), G = c.attrs.conv.feature_groups, X = x.size() / x.shape()[0] / C;
        for (std::int64_t i = 0; i < want.size(); ++i) {
          const std::int64_t o = i % O, p = i / O % s.positions, n = i / O / s.positions;
          double sum = 0;
          for (std::int64_t t = 0; t < s.taps; ++t)
            if (const std::int64_t at = kernels::window_source(s, p, t); at >= 0)
              for (std::int64_t ch = 0; ch < C / G; ++ch)
                sum += x.at((n * X + at) * C + o / (O / G) * (C / G) + ch) * args[1].at((t * (C / G) + ch) * O + o);
          got.set(i, sum);
        }
      } else {  // one thread per window
        const bool scatter = c.kind == OpKind::select_and_scatter;
        const kernels::WindowShape s =
            kernels::window_shape(c.kind, x.shape(), c.attrs.window.window, scatter ? args[1].shape() : want.shape(), c.attrs);
        for (std::int64_t p = 0; p < s.positions; ++p) {
          double r = c.kind == OpKind::reduce_window_sum ? 0 : -INFINITY;
          std::int64_t best = -1;
          for (std::int64_t t = 0; t < s.taps; ++t)
            if (const std::int64_t at = kernels::window_source(s, p, t); at >= 0) {
              if (c.kind == OpKind::reduce_window_sum) r += x.at(at);
              else if (best < 0 || x.at(at) > r) r = x.at(at), best = at;
            }
          if (!scatter) got.set(p, r);
          else if (best >= 0) got.set(best, got.at(best) + args[1].at(p));
        }
      }
      CHECK(error(got, want) <= 1e-12);
    }
  }

  TEST_CASE("gemm plans: the cuBLAS call, run through a reference of cuBLAS's semantics, equals dot_general") {
    Rng rng(14);
    for (const auto& d : dot_cases()) {
      const Array lhs = random_array(rng, {d.lhs, DType::f64}), rhs = random_array(rng, {d.rhs, DType::f64});
      Attrs a;
      a.dot = d.dims;
      NamedArrays inputs;
      const Array want = interpret(one_op(OpKind::dot_general, {lhs, rhs}, a, inputs), inputs).at("y");
      const gpu::GemmPlan g = gpu::plan_gemm(d.lhs, d.rhs, d.dims);
      auto operand = [](const gpu::GemmOperand& o, const Array& x) {
        if (!o.copied) return x;
        Array copied(TensorType{o.copy.shape, x.dtype()});
        apply_view(o.copy, x, copied);
        return copied;
      };
      const Array A = operand(g.a, lhs), B = operand(g.b, rhs);
      INFO(to_string(lhs.type()) << " x " << to_string(rhs.type()) << (g.a.copied ? " (lhs copied)" : "")
                                 << (g.b.copied ? " (rhs copied)" : ""));
      // The arguments dot_general passes: cuBLAS's A is the rhs, its B the lhs, m = n and n = m.
      const bool ta = g.transpose_first(), tb = g.transpose_second();
      const std::int64_t m = g.n, n = g.m, k = g.k;
      CHECK(g.b.ld >= std::max<std::int64_t>(1, ta ? k : m));  // cuBLAS's lda rule
      CHECK(g.a.ld >= std::max<std::int64_t>(1, tb ? n : k));  // ldb
      CHECK(g.ldc() >= std::max<std::int64_t>(1, m));          // ldc
      Array got(want.type());
      for (std::int64_t p = 0; p < g.batch; ++p)
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t j = 0; j < n; ++j) {
            double sum = 0;
            for (std::int64_t l = 0; l < k; ++l) {
              const double av = B.at(p * g.b.batch_stride + (ta ? l + i * g.b.ld : i + l * g.b.ld));
              const double bv = A.at(p * g.a.batch_stride + (tb ? j + l * g.a.ld : l + j * g.a.ld));
              sum += av * bv;
            }
            got.set(p * g.stride_c() + i + j * g.ldc(), sum);
          }
      CHECK(error(got, want) <= 1e-12);
    }
  }

  TEST_CASE("without a GPU: every entry point says that no CUDA device is present") {
    if (gpu::device_count() > 0) {
      MESSAGE("a CUDA device is present: the no-device messages are not exercised here");
      return;
    }
    CHECK_FALSE(gpu::probe_devices().reason.empty());
    CHECK_THROWS_WITH_AS(nccl::Communicator(), doctest::Contains("no CUDA device is present"), UserError);
    CHECK_THROWS_WITH_AS(nccl::run(1, [](nccl::Communicator&) {}), doctest::Contains("nccl::run: no CUDA device is present"),
                         UserError);
    CHECK_THROWS_WITH_AS(gpu::require_devices(2, "bench"), doctest::Contains("bench: no CUDA device is present"), UserError);
  }
}

// ---------------------------------------------------------------- device suite: needs a GPU

TEST_SUITE("device") {
  TEST_CASE("gpu: unary and binary ops match the Eigen kernels (f32, f64, bf16, f16)") {
    Rng rng(1);
    for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16})
      for (const Shape& shape : {Shape{}, Shape{7}, Shape{33, 65}, Shape{4, 1000}}) {
        const Array x = random_array(rng, {shape, t}, 0.1, 3), y = random_array(rng, {shape, t}, 0.1, 3);
        for (OpKind k : {OpKind::neg, OpKind::exp, OpKind::log, OpKind::tanh, OpKind::rsqrt, OpKind::sqrt, OpKind::abs})
          CHECK_GPU_OP(k, std::vector{x});
        for (OpKind k : {OpKind::add, OpKind::sub, OpKind::mul, OpKind::div, OpKind::max, OpKind::min, OpKind::pow})
          CHECK_GPU_OP(k, (std::vector{x, y}));
      }
  }

  TEST_CASE("gpu: compare, select and convert for every dtype") {
    Rng rng(2);
    for (DType t : {DType::f32, DType::f64, DType::i32, DType::bf16, DType::f16}) {
      const Array x = random_array(rng, {{5, 9}, t}), y = random_array(rng, {{5, 9}, t});
      for (CompareDir d : {CompareDir::eq, CompareDir::ne, CompareDir::lt, CompareDir::le, CompareDir::gt, CompareDir::ge}) {
        Attrs a;
        a.cmp = d;
        CHECK_GPU_OP(OpKind::compare, (std::vector{x, y}), a);
      }
      for (DType v : {DType::f32, DType::f64, DType::i32, DType::bf16, DType::f16}) {
        const Array on = random_array(rng, {{5, 9}, v}), off = random_array(rng, {{5, 9}, v});
        CHECK_GPU_OP(OpKind::select, (std::vector{x, on, off}));
        Attrs a;
        a.dtype = v;
        CHECK_GPU_OP(OpKind::convert, std::vector{x}, a);
      }
    }
  }

  TEST_CASE("gpu: constants, splat and per element") {
    for (DType t : {DType::f32, DType::i32, DType::bf16}) {
      Program p("c");
      Attrs splat;
      splat.shape = {3, 4};
      splat.dtype = t;
      splat.literal = {2.5};
      Attrs each = splat;
      each.literal = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
      p.add_output("s", p.add(OpKind::constant, {}, splat));
      p.add_output("e", p.add(OpKind::constant, {}, each));
      const auto want = interpret(p, NamedArrays{});
      const auto got = gpu::execute(on_one_device(p), gpu_comm(), {}).outputs;
      CHECK(got.at("s") == want.at("s"));
      CHECK(got.at("e") == want.at("e"));
    }
  }

  TEST_CASE("gpu: dot_general on cuBLAS, in-place and transposed layouts, batched") {
    Rng rng(3);
    const std::vector<DotCase> dots = [] {
      auto cases = dot_cases();
      cases.push_back({{256, 1024}, {1024, 512}, {{}, {}, {1}, {0}}});  // GEMM-sized
      return cases;
    }();
    for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16})
      for (const auto& d : dots) {
        Attrs a;
        a.dot = d.dims;
        const std::vector args{random_array(rng, {d.lhs, t}), random_array(rng, {d.rhs, t})};
        INFO(describe(OpKind::dot_general, args));
        // Sums of up to 1024 products in another order: tolerance grows with the contracted size. 16-bit
        // operands: exact products summed in f32 on both sides (tensor cores here), then one rounding.
        CHECK(gpu_vs_cpu(OpKind::dot_general, args, a) <= (t == DType::f32 ? 2e-4 : t == DType::f64 ? 1e-11 : tolerance(t)));
      }
  }

  TEST_CASE("gpu: reduce_sum and reduce_max over dim subsets, empty reductions included") {
    Rng rng(4);
    const Shape shape{6, 5, 130};
    for (DType t : {DType::f32, DType::f64, DType::i32, DType::bf16, DType::f16})
      for (const std::vector<std::int64_t>& dims : {std::vector<std::int64_t>{}, {0}, {1}, {2}, {0, 2}, {0, 1, 2}}) {
        Attrs a;
        a.dims = dims;
        const std::vector args{random_array(rng, {shape, t})};
        CHECK(gpu_vs_cpu(OpKind::reduce_sum, args, a) <= std::max(tolerance(t), 1e-12));
        CHECK(gpu_vs_cpu(OpKind::reduce_max, args, a) == 0);
      }
    Attrs a;
    a.dims = {1};
    CHECK(gpu_vs_cpu(OpKind::reduce_max, std::vector{Array(TensorType{{3, 0}, DType::f32})}, a) == 0);
    for (DType t : {DType::f32, DType::f64, DType::i32, DType::bf16, DType::f16}) {  // few outputs over many elements: the split path
      const std::vector args{random_array(rng, {{3, 70000}, t})};
      for (const std::vector<std::int64_t>& dims : {std::vector<std::int64_t>{1}, {0, 1}}) {
        Attrs r;
        r.dims = dims;
        INFO(to_string(args[0].type()) << " over " << dims.size() << " dims");
        // Sums of up to 210000 f32 values in another order: the CPU's own rounding reaches ~1e-4 absolute.
        // 16-bit: f32 sums of the chunks (not 16-bit ones), rounded once.
        CHECK(gpu_vs_cpu(OpKind::reduce_sum, args, r) <= (t == DType::f32 ? 1e-4 : t == DType::f64 || t == DType::i32 ? 1e-11 : tolerance(t)));
        CHECK(gpu_vs_cpu(OpKind::reduce_max, args, r) == 0);
      }
    }
  }

  TEST_CASE("gpu: broadcast, reshape, transpose, slice, pad, concatenate") {
    Rng rng(5);
    for (DType t : {DType::f32, DType::f64, DType::i32, DType::bf16}) {
      const Array x = random_array(rng, {{4, 1, 6}, t});
      Attrs b;
      b.dims = {0, 1, 3};
      b.shape = {4, 5, 3, 6};
      CHECK_GPU_OP(OpKind::broadcast_in_dim, std::vector{x}, b);
      Attrs r;
      r.shape = {6, 4};
      CHECK_GPU_OP(OpKind::reshape, std::vector{x}, r);
      const Array y = random_array(rng, {{3, 40, 50}, t});
      for (const std::vector<std::int64_t>& perm : {std::vector<std::int64_t>{2, 1, 0}, {0, 2, 1}, {1, 0, 2}}) {
        Attrs p;
        p.dims = perm;
        CHECK_GPU_OP(OpKind::transpose, std::vector{y}, p);
      }
      Attrs s;
      s.lo = {1, 3, 7};
      s.hi = {3, 30, 50};
      CHECK_GPU_OP(OpKind::slice, std::vector{y}, s);
      Attrs pad;
      pad.lo = {1, 0, 2};
      pad.hi = {0, 3, 1};
      CHECK_GPU_OP(OpKind::pad, std::vector{y}, pad);
      Attrs c;
      c.axis = 1;
      CHECK_GPU_OP(OpKind::concatenate, (std::vector{y, random_array(rng, {{3, 7, 50}, t})}), c);
    }
  }

  TEST_CASE("gpu: gather rows and scatter_add them back, repeated indices included") {
    Rng rng(6);
    for (DType t : {DType::f32, DType::f64, DType::bf16}) {
      const Array table = random_array(rng, {{50, 16}, t});
      Array indices({2, 20}, std::vector<std::int32_t>(40));
      for (std::int64_t i = 0; i < 40; ++i) indices.set(i, static_cast<double>((i * 7) % 50 / (i % 3 + 1)));
      CHECK_GPU_OP(OpKind::gather, (std::vector{table, indices}));
      Attrs a;
      a.shape = {50, 16};
      // 16-bit: atomics add in 16 bits, one rounding per repeated index (up to 3 here) where the CPU sums in f32.
      CHECK(gpu_vs_cpu(OpKind::scatter_add, std::vector{indices, random_array(rng, {{2, 20, 16}, t})}, a) <=
            (is_half(t) ? 4 : 1) * tolerance(t));
    }
  }

  TEST_CASE("gpu: convolutions and poolings (strided, padded, dilated, flipped, grouped) match the CPU kernels") {
    Rng rng(18);
    for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16})
      for (const WindowCase& c : window_cases()) {
        const std::vector<Array> args = window_operands(rng, c, t);
        INFO(describe(c.kind, args));
        // 16-bit select_and_scatter: atomics add in 16 bits where windows overlap (up to 2 here), the CPU in f32.
        CHECK(gpu_vs_cpu(c.kind, args, c.attrs) <= (c.kind == OpKind::select_and_scatter && is_half(t) ? 3 : 1) * tolerance(t));
      }
  }

  TEST_CASE("gpu: an out-of-range gather index is a user error, as on the CPU") {
    Array table({4, 2}, std::vector<float>(8, 1.f));
    Array indices({2}, std::vector<std::int32_t>{1, 9});
    NamedArrays inputs;
    const Program p = one_op(OpKind::gather, {table, indices}, {}, inputs);
    CHECK_THROWS_WITH_AS(gpu::execute(on_one_device(p), gpu_comm(), inputs), doctest::Contains("out of range"), UserError);
  }

  TEST_CASE("gpu: gather and scatter_add on a block of a row-tiled table; indices are checked against all rows") {
    // The executor's row_shard path: this device holds rows [4, 8) of a 12-row table. Rows it does not hold
    // give zeros (gather) or are skipped (scatter_add); an index outside [0, 12) fails as on the CPU, where
    // row_sharded checks every index against the global row count. Launched directly on the default stream.
    const std::int64_t rows = 4, first = 4, global = 12, row = 3;
    std::vector<float> table(static_cast<std::size_t>(rows * row));
    for (std::size_t i = 0; i < table.size(); ++i) table[i] = static_cast<float>(i + 1);
    const std::vector<std::int32_t> idx{0, 5, 7, 11, 4, 5, 3};
    const auto n = static_cast<std::int64_t>(idx.size());
    std::vector<float> updates(static_cast<std::size_t>(n * row));
    for (std::size_t i = 0; i < updates.size(); ++i) updates[i] = static_cast<float>(i % 5 + 1);  // exact sums
    std::vector<float> want_rows(static_cast<std::size_t>(n * row), 0.f), want_sum(table.size(), 0.f);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t r = idx[static_cast<std::size_t>(i)] - first;
      if (r < 0 || r >= rows) continue;
      for (std::int64_t e = 0; e < row; ++e) {
        want_rows[static_cast<std::size_t>(i * row + e)] = table[static_cast<std::size_t>(r * row + e)];
        want_sum[static_cast<std::size_t>(r * row + e)] += updates[static_cast<std::size_t>(i * row + e)];
      }
    }
    auto* d_table = to_device(table);
    auto* d_idx = to_device(idx);
    auto* d_updates = to_device(updates);
    auto* d_out = to_device(std::vector<float>(want_rows.size(), -1.f));
    auto* d_sum = to_device(std::vector<float>(want_sum.size(), 0.f));
    auto* d_bad = to_device(std::vector<int>{0});
    gpu::launch::gather(DType::f32, d_table, d_idx, d_out, n, rows, row, first, global, d_bad, nullptr);
    CHECK(to_host(d_out, want_rows.size()) == want_rows);
    gpu::launch::scatter_add(DType::f32, d_idx, d_updates, d_sum, n, rows, row, first, global, d_bad, nullptr);
    CHECK(to_host(d_sum, want_sum.size()) == want_sum);
    CHECK(to_host(d_bad, 1)[0] == 0);
    for (std::int32_t outside : {12, -1}) {
      INFO("index " << outside);
      auto* d_outside = to_device(std::vector<std::int32_t>{5, outside});
      const auto reset = std::vector<int>{0};
      gpu::launch::gather(DType::f32, d_table, d_outside, d_out, 2, rows, row, first, global, d_bad, nullptr);
      CHECK(to_host(d_bad, 1)[0] == 1);
      REQUIRE(cudaMemcpy(d_bad, reset.data(), sizeof(int), cudaMemcpyHostToDevice) == cudaSuccess);
      gpu::launch::scatter_add(DType::f32, d_outside, d_updates, d_sum, 2, rows, row, first, global, d_bad, nullptr);
      CHECK(to_host(d_bad, 1)[0] == 1);
      REQUIRE(cudaMemcpy(d_bad, reset.data(), sizeof(int), cudaMemcpyHostToDevice) == cudaSuccess);
      gpu::launch::gather(DType::f32, d_table, d_outside, d_out, 2, rows, 0, first, global, d_bad, nullptr);  // empty rows
      CHECK(to_host(d_bad, 1)[0] == 1);
      REQUIRE(cudaMemcpy(d_bad, reset.data(), sizeof(int), cudaMemcpyHostToDevice) == cudaSuccess);
      cudaFree(d_outside);
    }
    for (void* p : {static_cast<void*>(d_table), static_cast<void*>(d_idx), static_cast<void*>(d_updates),
                    static_cast<void*>(d_out), static_cast<void*>(d_sum), static_cast<void*>(d_bad)})
      cudaFree(p);
  }

  TEST_CASE("gpu: tile moves of the collectives match layout::pack and unpack") {
    Rng rng(7);
    const Array x = random_array(rng, {{6, 8, 10}, DType::f32});
    for (std::int64_t dim : {0, 1, 2}) {
      const std::int64_t tiles = 2;
      std::vector<std::byte> want(static_cast<std::size_t>(x.bytes()));
      layout::pack(x, dim, tiles, want.data());
      void *in = nullptr, *out = nullptr;
      REQUIRE(cudaMalloc(&in, static_cast<std::size_t>(x.bytes())) == cudaSuccess);
      REQUIRE(cudaMalloc(&out, static_cast<std::size_t>(x.bytes())) == cudaSuccess);
      cudaMemcpy(in, layout::bytes(x), static_cast<std::size_t>(x.bytes()), cudaMemcpyHostToDevice);
      gpu::copy(gpu::tiles_view(x.shape(), dim, tiles, true), in, out, DType::f32, nullptr);
      std::vector<std::byte> got(want.size());
      cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost);
      CHECK(got == want);
      gpu::copy(gpu::tiles_view(x.shape(), dim, tiles, false), out, in, DType::f32, nullptr);  // and back
      Array back(x.type());
      cudaMemcpy(layout::bytes(back), in, got.size(), cudaMemcpyDeviceToHost);
      CHECK(back == x);
      cudaFree(in);
      cudaFree(out);
    }
  }

  TEST_CASE("gpu: an MLP train step with Adam matches interpret() over three steps, and allocates nothing after the first") {
    nn::Mlp model{"params/mlp", {64, 256, 64}};
    auto loss = [&](Tensor x, Tensor y) { return mse(model(x), y); };
    const Program step = train_step(loss, Adam{1e-3}, {{"x", {32, 64}}, {"y", {32, 64}}});
    const SpmdProgram spmd = on_one_device(step);
    NamedArrays cpu = init_inputs(step, 0, true), gpu_state = cpu;
    std::int64_t allocations = 0;
    for (int s = 0; s < 3; ++s) {
      NamedArrays want = interpret(step, cpu);
      NamedArrays got = gpu::execute(spmd, gpu_comm(), gpu_state).outputs;
      for (const auto& [name, a] : want) {
        INFO("step " << s << " output " << name);
        CHECK(error(got.at(name), a) <= 1e-4);
      }
      carry_state(step, cpu, std::move(want));
      carry_state(step, gpu_state, std::move(got));
      const auto now = gpu::context(gpu_comm().gpu()).pool.allocations();
      if (s > 0) CHECK(now == allocations);
      allocations = now;
    }
  }

  TEST_CASE("gpu: an Executable on the NCCL communicator steps on the GPU as interpret() does, in f32 and bf16") {
    for (DType compute : {DType::f32, DType::bf16}) {
      INFO(name_of(compute));
      nn::Mlp model{"params/mlp", {32, 64, 32}};
      const Program step = train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{1e-3},
                                      {{"x", {16, 32}}, {"y", {16, 32}}}, MixedPrecision::with_compute(compute));
      // bf16: both sides compute in f32 and round to bf16 at the same places; a last-bit difference (exp,
      // summation order) moves the f32 loss and the f32 master weights by far less than 1%.
      const double tol = compute == DType::f32 ? 1e-4 : 1e-2;
      const Executable exe(on_one_device(step), gpu_comm());
      NamedArrays state = exe.init(5), want = init_inputs(step, 5);
      for (int s = 0; s < 3; ++s) {
        NamedArrays batch = init_inputs(step, 100 + static_cast<std::uint64_t>(s), true), in = want;
        std::erase_if(batch, [](const auto& kv) { return kv.first != "x" && kv.first != "y"; });
        for (const auto& [name, a] : batch) in[name] = a;
        NamedArrays expect = interpret(step, in);
        const DeviceResult r = exe.step(state, batch);
        CHECK(error(r.outputs.at("loss"), expect.at("loss")) <= tol);
        CHECK(r.gpu_seconds > 0);  // the ops' own time, measured with CUDA events
        carry_state(step, want, std::move(expect));
      }
      for (const auto& [name, a] : exe.gather_state(state)) {
        INFO(name);
        CHECK(error(a, want.at(name)) <= tol);
      }
    }
  }

  TEST_CASE("gpu: host buffers through the NCCL communicator are staged and come back") {
    Group one{{0}};
    std::vector<float> data{1, 2, 3}, out(3);
    gpu_comm().all_reduce(one, data.data(), 3, DType::f32);
    CHECK(data == std::vector<float>{1, 2, 3});
    gpu_comm().all_gather(one, data.data(), out.data(), 3, DType::f32);
    CHECK(out == data);
    gpu_comm().barrier();
  }
}

int main(int argc, char** argv) {
  bool host_only = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--host") == 0) host_only = true;
    else args.push_back(argv[i]);
  }
  doctest::Context context(static_cast<int>(args.size()), args.data());
  if (host_only) {
    context.addFilter("test-suite", "host");
  } else {
    const gpu::DeviceCount d = gpu::probe_devices();
    if (d.count == 0) {
      std::cout << "test_gpu: no CUDA device is present (" << d.reason << "); skipping the GPU kernel tests\n";
      return 77;
    }
    context.addFilter("test-suite", "device");
  }
  return context.run();
}
