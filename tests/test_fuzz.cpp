// Randomized differential testing: random well-typed programs (from the op set, random shapes; sometimes
// with their gradients or as a whole Adam or SGD train step; a quarter computing in bf16) under random schedules
// (ManualPartition of random inputs, tags, dims and axes, Replicate, presets) on random meshes. Every plan that
// partition() accepts must lower and run on the threads backend with every device's outputs equal to the
// single-device interpreter's (within the tolerance disagreement() states).
// A failing case is shrunk (tactics dropped, the program cut to its shortest failing prefix) and printed as a
// program to paste into a test.
//   PARTIR_FUZZ_CASES=N (default 2000)  PARTIR_FUZZ_SEED=S (default 1)  PARTIR_FUZZ_CASE=I (only case I)
//   PARTIR_FUZZ_OPS=K (default 12: up to K+1 ops per program)
// The long mode is more cases and bigger programs, e.g. PARTIR_FUZZ_CASES=100000 PARTIR_FUZZ_OPS=30.
#include <doctest/doctest.h>

#include <partir/partir.hpp>

#include <array>
#include <cmath>
#include <numeric>
#include <optional>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <random>
#include <sstream>

using namespace partir;

namespace {

// One step of a program recipe. Steps refer to earlier results by position in the pool of values, so every
// prefix of a recipe is itself a valid program (what the shrinker relies on).
struct Step {
  enum Kind { input, ids, param, unary, binary, dot, reduce, transpose, reshape, broadcast, slice, concat, gather,
              select, softmax, pad, convert } kind;
  int a = -1, b = -1;
  int which = 0;                       // unary / binary / reduce flavour
  std::vector<std::int64_t> v1, v2;    // dims, perm, shape, bounds...
  Shape shape;                         // input / param / reshape / broadcast result shape
  std::string name;                    // inputs and params; tags of intermediates
};

struct Recipe {
  std::vector<Step> steps;
  int mode = 0;  // 0: forward outputs; 1: value_and_grad of sum(last^2); 2 (Adam), 3 (SGD): train step on that loss, clipped
  DType compute = DType::f32;  // bf16: traced under MixedPrecision::with_compute(bf16), master weights in f32
};

std::string shape_code(const Shape& s) {
  std::string out = "{";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "}";
}

constexpr OpKind unary_ops[] = {OpKind::neg, OpKind::tanh, OpKind::abs, OpKind::exp};
constexpr OpKind binary_ops[] = {OpKind::add, OpKind::sub, OpKind::mul, OpKind::max};
const char* const unary_names[] = {"neg", "tanh", "abs", "exp_tanh"};
const char* const binary_names[] = {"+", "-", "*", "maximum"};

// Applies one step to the pool inside a trace; returns the C++ line that does the same. `real`: the dtype of
// inputs and parameters (f64 builds the reference that judges rounding, see check()).
std::string apply(const Step& s, std::vector<Tensor>& pool, DType real = DType::f32) {
  auto v = [&](int i) { return "v" + std::to_string(i); };
  const std::string lhs = "Tensor " + v(static_cast<int>(pool.size())) + " = ";
  std::string code;
  Tensor r = [&]() -> Tensor {
    switch (s.kind) {
      case Step::input:
        code = "input(\"" + s.name + "\", " + shape_code(s.shape) + ")";
        return partir::input(s.name, s.shape, real);
      case Step::ids:
        code = "input(\"" + s.name + "\", " + shape_code(s.shape) + ", DType::i32)";
        return partir::input(s.name, s.shape, DType::i32);
      case Step::param:
        code = "param(\"" + s.name + "\", " + shape_code(s.shape) + ", normal_init(0.5))";
        return partir::param(s.name, s.shape, normal_init(0.5), real);
      case Step::unary: {
        const Tensor& x = pool[s.a];
        code = std::string(unary_names[s.which]) + "(" + v(s.a) + ")";
        if (s.which == 3) {
          code = "exp(tanh(" + v(s.a) + "))";
          return partir::exp(partir::tanh(x));  // bounded: the comparison stays meaningful
        }
        return unary(unary_ops[s.which], x);
      }
      case Step::binary:
        code = s.which == 3 ? "maximum(" + v(s.a) + ", " + v(s.b) + ")"
                            : v(s.a) + " " + binary_names[s.which] + " " + v(s.b);
        return binary(binary_ops[s.which], pool[s.a], pool[s.b]);
      case Step::dot: {
        DotDims d{s.v1.size() > 2 ? std::vector<std::int64_t>{s.v1[2]} : std::vector<std::int64_t>{},
                  s.v2.size() > 2 ? std::vector<std::int64_t>{s.v2[2]} : std::vector<std::int64_t>{},
                  {s.v1[0]}, {s.v2[0]}};
        code = "dot_general(" + v(s.a) + ", " + v(s.b) + ", {" + shape_code(d.lhs_batch) + ", " +
               shape_code(d.rhs_batch) + ", " + shape_code(d.lhs_contract) + ", " + shape_code(d.rhs_contract) + "})";
        return dot_general(pool[s.a], pool[s.b], d);
      }
      case Step::reduce:
        code = std::string(s.which ? "max" : "sum") + "(" + v(s.a) + ", " + shape_code(s.v1) + ")";
        return s.which ? partir::max(pool[s.a], s.v1) : sum(pool[s.a], s.v1);
      case Step::transpose:
        code = "transpose(" + v(s.a) + ", " + shape_code(s.v1) + ")";
        return partir::transpose(pool[s.a], s.v1);
      case Step::reshape:
        code = "reshape(" + v(s.a) + ", " + shape_code(s.shape) + ")";
        return partir::reshape(pool[s.a], s.shape);
      case Step::broadcast:
        code = "broadcast_in_dim(" + v(s.a) + ", " + shape_code(s.shape) + ", " + shape_code(s.v1) + ")";
        return broadcast_in_dim(pool[s.a], s.shape, s.v1);
      case Step::slice:
        code = "slice(" + v(s.a) + ", " + shape_code(s.v1) + ", " + shape_code(s.v2) + ")";
        return partir::slice(pool[s.a], s.v1, s.v2);
      case Step::concat:
        code = "concatenate({" + v(s.a) + ", " + v(s.b) + "}, " + std::to_string(s.which) + ")";
        return concatenate({pool[s.a], pool[s.b]}, s.which);
      case Step::gather:
        code = "gather(" + v(s.a) + ", " + v(s.b) + ")";
        return partir::gather(pool[s.a], pool[s.b]);
      case Step::select:
        code = "select(compare(" + v(s.a) + ", " + v(s.b) + ", CompareDir::gt), " + v(s.a) + ", " + v(s.b) + ")";
        return partir::select(compare(pool[s.a], pool[s.b], CompareDir::gt), pool[s.a], pool[s.b]);
      case Step::softmax:
        code = "softmax(" + v(s.a) + ", " + std::to_string(s.which) + ")";
        return partir::softmax(pool[s.a], s.which);
      case Step::pad:
        code = "pad(" + v(s.a) + ", " + shape_code(s.v1) + ", " + shape_code(s.v2) + ")";
        return partir::pad(pool[s.a], s.v1, s.v2);
      case Step::convert:
        code = "convert(convert(" + v(s.a) + ", DType::f64), " + v(s.a) + ".dtype())";
        return real == DType::f32 ? partir::convert(partir::convert(pool[s.a], DType::f64), pool[s.a].dtype())
                                  : partir::convert(partir::convert(pool[s.a], DType::f32), real);
    }
    internal_error("fuzz: unknown step");
  }();
  if (!s.name.empty() && s.kind != Step::input && s.kind != Step::ids && s.kind != Step::param) {
    tag(r, s.name);
    code = "tag(" + code + ", \"" + s.name + "\")";
  }
  pool.push_back(r);
  return lhs + code + ";";
}

// The program of the first `n` steps; outputs the last value (and, in modes 1-3, a scalar loss from it).
Program build(const Recipe& r, std::size_t n, std::string* code = nullptr, DType real = DType::f32) {
  // The f64 reference (real) is the exact program: no 16-bit policy.
  std::optional<MixedPrecision> policy;
  if (r.compute != DType::f32 && real == DType::f32) policy = MixedPrecision::with_compute(r.compute);
  std::optional<PrecisionScope> scope;
  if (policy && r.mode < 2) scope.emplace(*policy);
  auto body = [&](std::vector<Tensor>& pool) {
    for (std::size_t i = 0; i < n; ++i) {
      std::string line = apply(r.steps[i], pool, real);
      if (code) *code += "  " + line + "\n";
    }
  };
  auto loss_of = [](const Tensor& t) { return sum(t * t); };
  if (r.mode >= 2) {
    auto loss = [&](const std::vector<Tensor>&) {
      std::vector<Tensor> pool;
      body(pool);
      return loss_of(pool.back());
    };
    const StepOptions options{.precision = policy, .clip_norm = 1.0};  // clipping: the norm's sums, any layout
    return r.mode == 2 ? train_step(loss, Adam{1e-2}, {}, options, "fuzz") : train_step(loss, SGD{1e-2}, {}, options, "fuzz");
  }
  Program p = trace("fuzz", [&](const std::vector<Tensor>&) {
    std::vector<Tensor> pool;
    body(pool);
    NamedTensors out{{"out", pool.back()}};
    if (r.mode == 1) out.emplace_back("loss", loss_of(pool.back()));
    return out;
  }, {});
  if (r.mode == 1) {
    bool has_param = false;
    for (auto v : p.inputs()) has_param |= p.op(v).attrs.input_kind == InputKind::parameter;
    if (has_param) p = value_and_grad(p, "loss");
  }
  return p;
}

class Generator {
 public:
  explicit Generator(std::uint64_t seed, int max_ops = 12) : rng_(seed), max_ops_(max_ops) {}

  int pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng_); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  std::int64_t size() { return std::array<std::int64_t, 5>{2, 4, 4, 8, 6}[static_cast<std::size_t>(pick(5))]; }

  Recipe recipe() {
    Recipe r;
    r.mode = pick(4);
    if (chance(0.25)) r.compute = DType::bf16;
    // A max's or a select's gradient goes to the operand that wins, and 16-bit values tie often: a plan whose
    // partial sums round otherwise (test_transformer's bf16 test says why) can break a tie the other way and move
    // a whole gradient. bf16 programs with gradients leave them out.
    const bool ties_move_gradients = r.compute != DType::f32 && r.mode != 0;
    std::vector<Shape> shapes;  // of the pool
    auto push = [&](Step s, Shape result) {
      if (s.kind != Step::input && s.kind != Step::ids && s.kind != Step::param && chance(0.3))
        s.name = "t" + std::to_string(shapes.size());
      r.steps.push_back(std::move(s));
      shapes.push_back(std::move(result));
      return static_cast<int>(shapes.size()) - 1;
    };
    auto new_input = [&](Shape shape) {
      const bool is_param = r.mode != 0 ? chance(0.6) : chance(0.3);
      std::string name = (is_param ? "params/p" : "x") + std::to_string(shapes.size());
      return push({is_param ? Step::param : Step::input, -1, -1, 0, {}, {}, shape, name}, shape);
    };
    auto random_shape = [&] {
      Shape s(static_cast<std::size_t>(1 + pick(3)));
      for (auto& d : s) d = size();
      return s;
    };
    auto same_shape = [&](const Shape& want, int not_this) {
      std::vector<int> c;
      for (int i = 0; i < static_cast<int>(shapes.size()); ++i)
        if (shapes[static_cast<std::size_t>(i)] == want && i != not_this && r.steps[static_cast<std::size_t>(i)].kind != Step::ids)
          c.push_back(i);
      if (c.empty() || chance(0.3)) return new_input(want);
      return c[static_cast<std::size_t>(pick(static_cast<int>(c.size())))];
    };
    if (r.mode != 0) {  // a gradient needs a parameter
      const Shape s = random_shape();
      push({Step::param, -1, -1, 0, {}, {}, s, "params/p0"}, s);
    }
    int last = new_input(random_shape());
    if (chance(0.5)) last = new_input(random_shape());
    const int ops = 2 + pick(max_ops_);
    for (int k = 0; k < ops; ++k) {
      // Operate mostly on the newest value so programs are deep, not wide.
      int a = chance(0.7) ? last : pick(static_cast<int>(shapes.size()));
      if (r.steps[static_cast<std::size_t>(a)].kind == Step::ids) a = last;
      const Shape x = shapes[static_cast<std::size_t>(a)];
      const auto rank = static_cast<std::int64_t>(x.size());
      const int d = rank ? pick(static_cast<int>(rank)) : 0;
      switch (pick(15)) {
        case 0:
        case 1: last = push({Step::unary, a, -1, pick(4)}, x); break;
        case 2:
        case 3: {
          const int b = same_shape(x, a);
          last = push({Step::binary, a, b, pick(ties_move_gradients ? 3 : 4)}, x);
          break;
        }
        case 4:
        case 5: {  // contract dim d of x with a new or existing [k, n] (optionally batched over another dim)
          if (rank == 0) break;
          const std::int64_t n = size();
          Step s{Step::dot, a};
          Shape bshape{x[static_cast<std::size_t>(d)], n};
          Shape result;
          std::int64_t batch = -1;
          if (rank >= 2 && chance(0.4)) batch = (d + 1) % rank;
          if (batch >= 0) bshape.push_back(x[static_cast<std::size_t>(batch)]);
          const int b = same_shape(bshape, -1);
          s.b = b;
          s.v1 = {d, 0};
          s.v2 = {0, 0};
          if (batch >= 0) {
            s.v1.push_back(batch);
            s.v2.push_back(2);
            result.push_back(x[static_cast<std::size_t>(batch)]);
          }
          for (std::int64_t i = 0; i < rank; ++i)
            if (i != d && i != batch) result.push_back(x[static_cast<std::size_t>(i)]);
          result.push_back(n);
          last = push(s, result);
          break;
        }
        case 6: {
          if (rank == 0) break;
          Shape result = x;
          result.erase(result.begin() + d);
          last = push({Step::reduce, a, -1, !ties_move_gradients && chance(0.3) ? 1 : 0, {d}}, result);
          break;
        }
        case 7: {
          if (rank < 2) break;
          std::vector<std::int64_t> perm(static_cast<std::size_t>(rank));
          std::iota(perm.begin(), perm.end(), 0);
          std::shuffle(perm.begin(), perm.end(), rng_);
          Shape result;
          for (auto p : perm) result.push_back(x[static_cast<std::size_t>(p)]);
          last = push({Step::transpose, a, -1, 0, perm}, result);
          break;
        }
        case 8: {  // merge dims d, d+1, or split dim d in two
          Shape result = x;
          if (rank >= 2 && d + 1 < rank && chance(0.5)) {
            result[static_cast<std::size_t>(d)] *= result[static_cast<std::size_t>(d) + 1];
            result.erase(result.begin() + d + 1);
          } else if (rank >= 1 && rank < 4 && x[static_cast<std::size_t>(d)] % 2 == 0) {
            result[static_cast<std::size_t>(d)] /= 2;
            result.insert(result.begin() + d, 2);
          } else {
            break;
          }
          last = push({Step::reshape, a, -1, 0, {}, {}, result}, result);
          break;
        }
        case 9: {  // a new dim of size 2 or 4 at a random position
          if (rank >= 4) break;
          const int at = pick(static_cast<int>(rank) + 1);
          Shape result = x;
          result.insert(result.begin() + at, chance(0.5) ? 2 : 4);
          std::vector<std::int64_t> dims;
          for (std::int64_t i = 0; i <= rank; ++i)
            if (i != at) dims.push_back(i);
          last = push({Step::broadcast, a, -1, 0, dims, {}, result}, result);
          break;
        }
        case 10: {  // a half, or all but the first element, of dim d
          if (rank == 0 || x[static_cast<std::size_t>(d)] < 2) break;
          std::vector<std::int64_t> lo(static_cast<std::size_t>(rank), 0), hi(x.begin(), x.end());
          const auto n = x[static_cast<std::size_t>(d)];
          switch (pick(3)) {
            case 0: hi[static_cast<std::size_t>(d)] = n / 2; break;
            case 1: lo[static_cast<std::size_t>(d)] = n / 2; break;
            default: lo[static_cast<std::size_t>(d)] = 1; break;
          }
          Shape result = x;
          result[static_cast<std::size_t>(d)] = hi[static_cast<std::size_t>(d)] - lo[static_cast<std::size_t>(d)];
          last = push({Step::slice, a, -1, 0, lo, hi}, result);
          break;
        }
        case 11: {
          if (rank == 0) break;
          const int b = same_shape(x, -1);
          Shape result = x;
          result[static_cast<std::size_t>(d)] *= 2;
          last = push({Step::concat, a, b, d}, result);
          break;
        }
        case 12: {  // embedding lookup: a table [V, F] and i32 ids [B] or [B, S]
          const std::int64_t vocab = size(), features = size();
          const int table = new_input({vocab, features});
          Shape ids_shape{size()};
          if (chance(0.5)) ids_shape.push_back(size());
          const int ids = push({Step::ids, -1, -1, 0, {}, {}, ids_shape, "ids" + std::to_string(shapes.size())}, ids_shape);
          Shape result = ids_shape;
          result.push_back(features);
          last = push({Step::gather, table, ids}, result);
          break;
        }
        case 13: {
          if (chance(0.5) && !ties_move_gradients) {
            const int b = same_shape(x, a);
            last = push({Step::select, a, b}, x);
          } else if (rank >= 1) {
            last = push({Step::softmax, a, -1, d}, x);
          }
          break;
        }
        case 14: {
          if (rank == 0) break;
          if (chance(0.5)) {
            last = push({Step::convert, a}, x);
            break;
          }
          std::vector<std::int64_t> lo(static_cast<std::size_t>(rank), 0), hi = lo;
          lo[static_cast<std::size_t>(d)] = pick(3);
          hi[static_cast<std::size_t>(d)] = pick(3);
          Shape result = x;
          result[static_cast<std::size_t>(d)] += lo[static_cast<std::size_t>(d)] + hi[static_cast<std::size_t>(d)];
          last = push({Step::pad, a, -1, 0, lo, hi}, result);
          break;
        }
      }
    }
    // The result must depend on the last step so that every step of a prefix matters to the shrinker.
    if (last != static_cast<int>(shapes.size()) - 1) push({Step::unary, last, -1, 0}, shapes[static_cast<std::size_t>(last)]);
    return r;
  }

  Mesh mesh() {
    switch (pick(7)) {
      case 6: return Mesh{{"a", 2}, {"b", 2}, {"c", 2}};
      case 0: return Mesh{{"a", 2}};
      case 1: return Mesh{{"a", 4}};
      case 2: return Mesh{{"a", 2}, {"b", 2}};
      case 3: return Mesh{{"a", 1}, {"b", 2}};
      case 4: return Mesh{{"a", 2}, {"b", 1}};
      default: return Mesh{{"a", 4}, {"b", 2}};
    }
  }

  // 1-3 tactics over the program's named values, preferring dims the axis divides.
  Schedule schedule(const Program& p, const Mesh& mesh, int mode) {
    Schedule out;
    std::vector<ValueId> named;
    for (ValueId v = 0; v < p.size(); ++v)
      if (!p.op(v).name.empty() && p.type(v).rank() > 0) named.push_back(v);
    const int n = 1 + pick(4);
    for (int t = 0; t < n; ++t) {
      const std::string axis = mesh.axes()[static_cast<std::size_t>(pick(static_cast<int>(mesh.axes().size())))].name;
      const int kind = pick(10);
      if (kind == 0) {
        out.push_back(data_parallel(axis));
      } else if (kind == 1 && mode >= 2) {
        out.push_back(chance(0.5) ? Tactic(zero2(axis)) : Tactic(zero3(axis)));
      } else if (kind == 2 && !named.empty()) {
        out.push_back(Replicate{p.op(named[static_cast<std::size_t>(pick(static_cast<int>(named.size())))]).name, axis});
      } else if (!named.empty()) {
        std::vector<TileRequest> tiles;
        const int k = 1 + (chance(0.3) ? 1 : 0);
        for (int i = 0; i < k; ++i) {
          const ValueId v = named[static_cast<std::size_t>(pick(static_cast<int>(named.size())))];
          const auto& shape = p.type(v).shape;
          std::vector<std::int64_t> ok;
          for (std::size_t d = 0; d < shape.size(); ++d)
            if (shape[d] % mesh.axes()[static_cast<std::size_t>(mesh.axis_index(axis))].size == 0)
              ok.push_back(static_cast<std::int64_t>(d));
          const std::int64_t dim = !ok.empty() && chance(0.9) ? ok[static_cast<std::size_t>(pick(static_cast<int>(ok.size())))]
                                                             : pick(static_cast<int>(shape.size()));
          tiles.push_back({p.op(v).name, dim});
        }
        out.push_back(ManualPartition{tiles, axis});
      }
    }
    return out;
  }

  NamedArrays inputs(const Program& p) {
    NamedArrays in;
    for (auto v : p.inputs()) {
      const Op& op = p.op(v);
      Array a(op.type);
      std::uniform_real_distribution<double> u(-1, 1);
      // Adam's second moment and step count are never negative.
      const bool nonnegative = op.attrs.input_kind == InputKind::optimizer_state && op.name.find("/m/") == std::string::npos;
      for (std::int64_t i = 0; i < a.size(); ++i)
        a.set(i, op.type.dtype == DType::i32 ? pick(2) : nonnegative ? std::abs(u(rng_)) : u(rng_));
      in.emplace(op.name, std::move(a));
    }
    return in;  // ids are 0 or 1: valid rows of any table (the smallest vocab is 2)
  }

 private:
  std::mt19937_64 rng_;
  int max_ops_;
};

// The first element where a plan's output `have` is off the single-device `want`: beyond `tolerance` times want's
// largest magnitude (at least 1) and, judged against `exact` (the program in f64, asked for only then), more than 8
// times as far from it as want's worst element. The second test is for outputs whose values cancel (a gradient
// through a softmax's row sums is 0 in exact arithmetic): both results are rounding noise there, of the same size.
// Tolerance: 1e-4 for f32; 0.1 for programs computing in bf16, whose partial sums a plan rounds to 16 bits at
// other points (test_transformer's bf16 differential test says why), by an ulp (2^-8) that chains of up to 30 ops
// grow: still far below what a wrong layout or a missing reduction does.
std::optional<std::int64_t> disagreement(const Array& have, const Array& want, DType compute,
                                         const std::function<const Array&()>& exact) {
  const double tolerance = compute == DType::f32 ? 1e-4 : 0.1;
  double scale = 1;
  for (std::int64_t i = 0; i < want.size(); ++i) scale = std::max(scale, std::abs(want.at(i)));
  std::optional<double> noise;
  for (std::int64_t i = 0; i < want.size(); ++i) {
    if (std::abs(have.at(i) - want.at(i)) <= tolerance * scale) continue;
    const Array& truth = exact();
    if (!noise) {
      noise = 0.0;
      for (std::int64_t k = 0; k < want.size(); ++k) noise = std::max(*noise, std::abs(want.at(k) - truth.at(k)));
    }
    if (!(std::abs(have.at(i) - truth.at(i)) <= 8 * *noise)) return i;
  }
  return std::nullopt;
}

struct Case {
  Recipe recipe;
  std::size_t steps = 0;  // prefix length
  Mesh mesh{{"a", 1}};
  Schedule schedule;
  std::uint64_t input_seed = 0;
  std::int64_t bucket_bytes = 0;  // collective buckets (spmd/bucket.hpp), 0: off
  std::int64_t prefetch_bytes = one_collective_ahead;  // how far collectives move up (spmd/schedule.hpp)
  LowerOptions lower_options() const { return {.bucket_bytes = bucket_bytes, .prefetch_bytes = prefetch_bytes}; }
};

// "" if the case passes or partition() rejects the plan as a user error; else what went wrong.
// A program the recipe cannot build (a prefix without parameters in a gradient mode) counts as rejected.
std::string check(const Case& c, bool* rejected = nullptr) {
  std::optional<Program> built;
  try {
    built = build(c.recipe, c.steps);
  } catch (const UserError& e) {
    if (rejected) *rejected = true;
    return rejected ? "" : std::string("the recipe does not build: ") + e.what();
  }
  const Program& prog = *built;
  Partitioned plan = [&]() -> Partitioned {
    try {
      return partition(prog, c.mesh, c.schedule);
    } catch (const UserError&) {
      if (rejected) *rejected = true;
      return partition(prog, c.mesh, {});
    }
  }();
  if (rejected && *rejected) return "";
  Generator g(c.input_seed);
  const NamedArrays inputs = g.inputs(prog);
  try {
    const NamedArrays want = interpret(prog, inputs);
    const auto got = execute_on_threads(lower(plan, c.lower_options()), inputs);
    std::optional<NamedArrays> exact;  // the program in f64, run on first need
    auto exact_output = [&](const std::string& name) -> const Array& {
      if (!exact) {
        const Program wide_program = build(c.recipe, c.steps, nullptr, DType::f64);
        NamedArrays wide;  // the same values (Adam's step count stays f32)
        for (auto v : wide_program.inputs()) {
          const Op& op = wide_program.op(v);
          const Array& a = inputs.at(op.name);
          Array w(op.type);
          for (std::int64_t k = 0; k < a.size(); ++k) w.set(k, a.at(k));
          wide.emplace(op.name, std::move(w));
        }
        exact = interpret(wide_program, wide);
      }
      return exact->at(name);
    };
    for (std::size_t d = 0; d < got.size(); ++d)
      for (const auto& [name, expect] : want) {
        const Array& have = got[d].outputs.at(name);
        if (have.type() != expect.type())
          return "device " + std::to_string(d) + " output '" + name + "' is " + to_string(have.type()) + ", expected " +
                 to_string(expect.type());
        if (auto i = disagreement(have, expect, c.recipe.compute, [&]() -> const Array& { return exact_output(name); }))
          return "device " + std::to_string(d) + " output '" + name + "' element " + std::to_string(*i) + " is " +
                 std::to_string(have.at(*i)) + ", expected " + std::to_string(expect.at(*i));
      }
  } catch (const std::exception& e) {
    return std::string("exception: ") + e.what();
  }
  return "";
}

// Drops tactics and cuts the program while the case still fails; returns the smallest failing case.
Case shrink(Case c) {
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t t = 0; t < c.schedule.size(); ++t) {
      Case smaller = c;
      smaller.schedule.erase(smaller.schedule.begin() + static_cast<std::ptrdiff_t>(t));
      bool skip = false;
      if (!check(smaller, &skip).empty() && !skip) {
        c = std::move(smaller);
        progress = true;
        break;
      }
    }
    for (std::size_t n = 1; n < c.steps && !progress; ++n) {
      Case smaller = c;
      smaller.steps = n;
      bool skip = false;
      if (check(smaller, &skip).empty() || skip) continue;
      c = std::move(smaller);
      progress = true;
    }
    if (c.bucket_bytes != 0 && !progress) {
      Case smaller = c;
      smaller.bucket_bytes = 0;
      bool skip = false;
      if (!check(smaller, &skip).empty() && !skip) {
        c = std::move(smaller);
        progress = true;
      }
    }
    if (c.recipe.mode != 0) {
      Case smaller = c;
      smaller.recipe.mode = 0;
      bool skip = false;
      if (!check(smaller, &skip).empty() && !skip) {
        c = std::move(smaller);
        progress = true;
      }
    }
  }
  return c;
}

std::string describe(const Case& c, std::uint64_t seed, long index, int max_ops) {
  std::string code;
  build(c.recipe, c.steps, &code);
  std::ostringstream os;
  os << "reproduce: PARTIR_FUZZ_SEED=" << seed << " PARTIR_FUZZ_OPS=" << max_ops << " PARTIR_FUZZ_CASE=" << index
     << " build/tests/test_fuzz\n"
     << "shrunk case: mesh " << c.mesh.to_string() << ", mode "
     << std::array{"forward", "value_and_grad(sum(out^2))", "train_step Adam(sum(out^2)), clip_norm 1",
                   "train_step SGD(sum(out^2)), clip_norm 1"}[static_cast<std::size_t>(c.recipe.mode)]
     << ", compute " << name_of(c.recipe.compute)
     << ", input seed " << c.input_seed << ", buckets of " << c.bucket_bytes << " bytes, prefetch " << c.prefetch_bytes
     << " bytes\n  // program (inside partir::trace)\n"
     << code << "  // schedule\n";
  for (const auto& t : c.schedule) os << "  " << t.name() << "\n";
  os << "failure: " << check(c) << "\n";
  return os.str();
}

long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtol(v, nullptr, 10) : fallback;
}

}  // namespace

TEST_CASE("fuzz: a plan's rounding noise passes where the outputs cancel, a wrong value does not") {
  const Array exact_zero({3}, std::vector<double>{1e-13, -5e-13, 0});
  auto zero = [&]() -> const Array& { return exact_zero; };
  const Array noise({3}, std::vector<float>{7.4e-5f, -3.8e-4f, 0});  // the single-device f32 result
  CHECK_FALSE(disagreement(Array({3}, std::vector<float>{-1.5e-4f, 3.9e-4f, 2e-4f}), noise, DType::f32, zero));
  CHECK(disagreement(Array({3}, std::vector<float>{7.4e-5f, -3.8e-4f, 0.01f}), noise, DType::f32, zero) == 2);
  const Array exact({2}, std::vector<double>{1, 2}), want({2}, std::vector<float>{1, 2});
  auto truth = [&]() -> const Array& { return exact; };
  CHECK_FALSE(disagreement(Array({2}, std::vector<float>{1, 2.0001f}), want, DType::f32, truth));
  CHECK(disagreement(Array({2}, std::vector<float>{1, 2.001f}), want, DType::f32, truth) == 1);  // want is exact
  // A bf16 program's loss, rounded to the neighbouring bf16 value (4 apart at 748) by the plan's other partial sums.
  const Array loss({1}, std::vector<double>{747.9});
  auto exact_loss = [&]() -> const Array& { return loss; };
  const Array one({1}, std::vector<float>{748}), next({1}, std::vector<float>{744});
  CHECK_FALSE(disagreement(next, one, DType::bf16, exact_loss));
  CHECK(disagreement(next, one, DType::f32, exact_loss) == 0);
  CHECK(disagreement(Array({1}, std::vector<float>{600}), one, DType::bf16, exact_loss) == 0);
}

TEST_CASE("fuzz: random programs and schedules on random meshes match the single-device interpreter") {
  const auto seed = static_cast<std::uint64_t>(env_long("PARTIR_FUZZ_SEED", 1));
  const long cases = env_long("PARTIR_FUZZ_CASES", 2000);
  const int max_ops = static_cast<int>(std::max(1L, env_long("PARTIR_FUZZ_OPS", 12)));
  const long only = env_long("PARTIR_FUZZ_CASE", -1);
  long run = 0, rejected = 0, failed = 0, collectives = 0, buckets = 0, gather_buckets = 0;
  for (long i = only >= 0 ? only : 0; i < (only >= 0 ? only + 1 : cases); ++i) {
    Generator g(seed * 1000003 + static_cast<std::uint64_t>(i), max_ops);
    Case c;
    c.recipe = g.recipe();
    c.steps = c.recipe.steps.size();
    c.mesh = g.mesh();
    c.schedule = g.schedule(build(c.recipe, c.steps), c.mesh, c.recipe.mode);
    c.input_seed = seed + static_cast<std::uint64_t>(i);
    const int bucketing = g.pick(3);  // off, buckets of a few gradients, one big bucket
    c.bucket_bytes = bucketing == 0 ? 0 : bucketing == 1 ? 4 << g.pick(10) : std::int64_t{25} << 20;
    const int prefetch = g.pick(3);  // one ahead, none, everything as early as its operand
    c.prefetch_bytes = prefetch == 0 ? one_collective_ahead : prefetch == 1 ? 0 : std::int64_t{1} << 40;
    bool was_rejected = false;
    const std::string why = check(c, &was_rejected);
    ++run;
    rejected += was_rejected;
    if (!was_rejected && why.empty()) {
      try {
        for (const auto& info : lower(partition(build(c.recipe, c.steps), c.mesh, c.schedule), c.lower_options()).collectives()) {
          ++collectives;
          buckets += info.collective.reason.starts_with("bucket of");
          gather_buckets += info.collective.reason.starts_with("bucket of") && info.collective.kind == CollectiveKind::all_gather;
        }
      } catch (const std::exception&) {
      }
    }
    if (why.empty()) continue;
    ++failed;
    FAIL_CHECK(describe(shrink(c), seed, i, max_ops));
    if (failed >= 3) break;  // the first few shrunk cases say enough
  }
  MESSAGE("fuzz seed " << seed << ": " << run << " cases, " << rejected << " rejected by partition() as user errors, "
                       << failed << " failed, " << collectives << " collectives in the accepted plans (" << buckets
                       << " of them buckets, " << gather_buckets << " of all_gathers)");
  CHECK(run - rejected >= run / 2);  // the generator must mostly produce plans that run
}
