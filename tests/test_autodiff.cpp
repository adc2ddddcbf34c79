// Autodiff: the vector-Jacobian product of every op kind against central finite differences (in f64),
// optimizers against a hand computation, and a train step that learns; one test per diagnostic.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include <partir/autodiff/train_step.hpp>
#include <partir/dsl/llama.hpp>
#include <partir/runtime/state/init.hpp>
#include <partir/runtime/exec/interpreter.hpp>

using namespace partir;

namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

Array uniform(std::mt19937_64& gen, Shape shape, double lo = -1, double hi = 1) {
  Array a({std::move(shape), DType::f64});
  std::uniform_real_distribution<double> u(lo, hi);
  for (std::int64_t i = 0; i < a.size(); ++i) a.set(i, u(gen));
  return a;
}
// Magnitudes in [0.2, 1], either sign: away from the kinks of abs and the poles of div.
Array away_from_zero(std::mt19937_64& gen, Shape shape) {
  Array a = uniform(gen, std::move(shape), 0.2, 1);
  for (std::int64_t i = 0; i < a.size(); ++i)
    if (gen() % 2) a.set(i, -a.at(i));
  return a;
}
// a + x with x from away_from_zero: no element ties with a's (max, min, compare).
Array apart_from(std::mt19937_64& gen, const Array& a) {
  Array b = away_from_zero(gen, a.shape());
  for (std::int64_t i = 0; i < a.size(); ++i) b.set(i, a.at(i) + b.at(i));
  return b;
}
// A shuffle of 0, 0.25, 0.5, ...: all distinct (reduce_max).
Array distinct(std::mt19937_64& gen, Shape shape) {
  Array a({std::move(shape), DType::f64});
  std::vector<double> v(static_cast<std::size_t>(a.size()));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.25 * static_cast<double>(i) - 1;
  std::shuffle(v.begin(), v.end(), gen);
  for (std::int64_t i = 0; i < a.size(); ++i) a.set(i, v[static_cast<std::size_t>(i)]);
  return a;
}
Array indices(Shape shape, std::vector<std::int32_t> values) { return Array(std::move(shape), std::move(values)); }

InputSpec f64(const std::string& name, Shape shape) { return {name, std::move(shape), DType::f64}; }

// loss = sum(f(xs) * r) with a fixed random r, so one scalar covers f's whole Jacobian in a random
// direction. Checks d loss / d x of every float input x (parameters f declares too), element by element,
// against the central difference (loss(x + h) - loss(x - h)) / 2h: |grad - fd| <= tol * (1 + |fd|). With
// h = 1e-6 in f64 the difference is accurate to ~1e-10, so tol = 1e-6 leaves a wide margin and still
// catches any wrong rule.
void check_grad(const Fn& f, const std::vector<InputSpec>& specs, const NamedArrays& values, double h = 1e-6,
                double tol = 1e-6) {
  std::mt19937_64 gen(99);
  Program forward = trace("f", [&](const std::vector<Tensor>& xs) {
    Tensor y = f(xs);
    Array r = uniform(gen, y.shape());
    std::vector<double> rv(r.data<double>().begin(), r.data<double>().end());
    return NamedTensors{{"loss", sum(y * convert(constant(y.program(), rv, y.shape(), DType::f64), y.dtype()))}};
  }, specs);
  std::vector<std::string> wrt;
  for (auto v : forward.inputs())
    if (is_float(forward.type(v).dtype)) wrt.push_back(forward.op(v).name);
  NamedArrays at = init_inputs(forward, 3);  // the parameters f declares, unless `values` has them
  for (const auto& [name, array] : values) at.insert_or_assign(name, array);
  const Program with_grad = value_and_grad(forward, "loss", wrt);
  verify(with_grad);
  const NamedArrays out = interpret(with_grad, at);
  auto loss_at = [&](const std::string& name, std::int64_t i, double x) {
    NamedArrays moved = at;
    moved.at(name).set(i, x);
    return interpret(forward, moved).at("loss").at(0);
  };
  for (const auto& name : wrt) {
    const Array& g = out.at("grad/" + name);
    REQUIRE(g.type() == at.at(name).type());
    for (std::int64_t i = 0; i < g.size(); ++i) {
      const double x = at.at(name).at(i);
      const double fd = (loss_at(name, i, x + h) - loss_at(name, i, x - h)) / (2 * h);
      INFO("d loss / d " << name << "[" << i << "]");
      CHECK(g.at(i) == doctest::Approx(fd).epsilon(tol));
    }
  }
}

// One-input function of an f64 tensor.
void check_unary(const std::function<Tensor(const Tensor&)>& f, const Array& x) {
  check_grad([&](const std::vector<Tensor>& xs) { return f(xs[0]); }, {f64("x", x.shape())}, {{"x", x}});
}
void check_binary(const std::function<Tensor(const Tensor&, const Tensor&)>& f, const Array& a, const Array& b) {
  check_grad([&](const std::vector<Tensor>& xs) { return f(xs[0], xs[1]); },
             {f64("a", a.shape()), f64("b", b.shape())}, {{"a", a}, {"b", b}});
}

}  // namespace

TEST_CASE("autodiff: elementwise unary ops") {
  std::mt19937_64 gen(1);
  const Shape s{2, 3};
  SUBCASE("neg") { check_unary([](const Tensor& x) { return -x; }, uniform(gen, s)); }
  SUBCASE("exp") { check_unary([](const Tensor& x) { return exp(x); }, uniform(gen, s)); }
  SUBCASE("tanh") { check_unary([](const Tensor& x) { return tanh(x); }, uniform(gen, s)); }
  SUBCASE("abs") { check_unary([](const Tensor& x) { return abs(x); }, away_from_zero(gen, s)); }
  SUBCASE("log") { check_unary([](const Tensor& x) { return log(x); }, uniform(gen, s, 0.5, 2)); }
  SUBCASE("sqrt") { check_unary([](const Tensor& x) { return sqrt(x); }, uniform(gen, s, 0.5, 2)); }
  SUBCASE("rsqrt") { check_unary([](const Tensor& x) { return rsqrt(x); }, uniform(gen, s, 0.5, 2)); }
}

TEST_CASE("autodiff: elementwise binary ops") {
  std::mt19937_64 gen(2);
  const Shape s{3, 2};
  const Array a = uniform(gen, s);
  SUBCASE("add") { check_binary([](const Tensor& x, const Tensor& y) { return x + y; }, a, uniform(gen, s)); }
  SUBCASE("sub") { check_binary([](const Tensor& x, const Tensor& y) { return x - y; }, a, uniform(gen, s)); }
  SUBCASE("mul") { check_binary([](const Tensor& x, const Tensor& y) { return x * y; }, a, uniform(gen, s)); }
  SUBCASE("div") { check_binary([](const Tensor& x, const Tensor& y) { return x / y; }, a, away_from_zero(gen, s)); }
  SUBCASE("max") {
    check_binary([](const Tensor& x, const Tensor& y) { return maximum(x, y); }, a, apart_from(gen, a));
  }
  SUBCASE("min") {
    check_binary([](const Tensor& x, const Tensor& y) { return minimum(x, y); }, a, apart_from(gen, a));
  }
  SUBCASE("pow") {
    check_binary([](const Tensor& x, const Tensor& y) { return pow(x, y); }, uniform(gen, s, 0.5, 2), uniform(gen, s));
  }
  SUBCASE("the same value on both sides") {
    check_unary([](const Tensor& x) { return x * x + x / (x * x + 1.0) - pow(x, x); }, uniform(gen, s, 0.5, 2));
  }
  SUBCASE("scalar operands broadcast") {
    check_binary([](const Tensor& x, const Tensor& y) { return x * y + y; }, a, uniform(gen, {}));
  }
}

TEST_CASE("autodiff: compare has no gradient, select routes it by the mask") {
  std::mt19937_64 gen(3);
  const Array a = uniform(gen, {2, 4});
  check_binary([](const Tensor& x, const Tensor& y) {
    return select(compare(x, y, CompareDir::gt), x * y, exp(y)) + compare(x, y, CompareDir::lt) * x;
  }, a, apart_from(gen, a));
}

TEST_CASE("autodiff: convert") {
  std::mt19937_64 gen(4);
  SUBCASE("through f32 and back") {
    // The f32 rounding of x +- h limits the difference quotient to ~1e-7 / h: hence the larger step.
    check_grad([](const std::vector<Tensor>& xs) { return convert(convert(xs[0], DType::f32) * 3.0, DType::f64); },
               {f64("x", {5})}, {{"x", uniform(gen, {5})}}, 1e-2, 1e-4);
  }
  SUBCASE("from i32: no gradient to the integers") {
    check_grad([](const std::vector<Tensor>& xs) { return xs[0] * convert(xs[1], DType::f64); },
               {f64("x", {4}), {"n", {4}, DType::i32}}, {{"x", uniform(gen, {4})}, {"n", indices({4}, {3, -1, 0, 7})}});
  }
}

TEST_CASE("autodiff: dot_general") {
  std::mt19937_64 gen(5);
  auto check_dot = [&](Shape ls, Shape rs, DotDims d) {
    check_binary([&](const Tensor& x, const Tensor& y) { return dot_general(x, y, d); }, uniform(gen, ls),
                 uniform(gen, rs));
  };
  SUBCASE("matmul") { check_dot({3, 4}, {4, 5}, {{}, {}, {1}, {0}}); }
  SUBCASE("contracting the leading dims") { check_dot({4, 3}, {5, 4}, {{}, {}, {0}, {1}}); }
  SUBCASE("batch dims") { check_dot({2, 3, 4}, {2, 4, 5}, {{0}, {0}, {2}, {1}}); }
  SUBCASE("batch dims listed out of order") { check_dot({2, 3, 4}, {3, 2, 4, 5}, {{1, 0}, {0, 1}, {2}, {2}}); }
  SUBCASE("permuted multiple contracting dims around a batch dim") {
    // lhs [c1=3, f=2, c0=4, b=5], rhs [c0=4, b=5, f=6, c1=3] -> [5, 2, 6]
    check_dot({3, 2, 4, 5}, {4, 5, 6, 3}, {{3}, {1}, {2, 0}, {0, 3}});
  }
  SUBCASE("outer product") { check_dot({3}, {2, 2}, {{}, {}, {}, {}}); }
  SUBCASE("full contraction to a scalar") { check_dot({2, 3}, {3, 2}, {{}, {}, {0, 1}, {1, 0}}); }
  SUBCASE("both operands the same value") {
    check_unary([](const Tensor& x) { return matmul(x, transpose(x)); }, uniform(gen, {3, 4}));
  }
}

TEST_CASE("autodiff: reductions") {
  std::mt19937_64 gen(6);
  SUBCASE("reduce_sum over some dims") {
    check_unary([](const Tensor& x) { return sum(x, {0, 2}); }, uniform(gen, {2, 3, 4}));
  }
  SUBCASE("reduce_sum over all dims") { check_unary([](const Tensor& x) { return sum(x); }, uniform(gen, {2, 3})); }
  SUBCASE("reduce_max over one dim") {
    check_unary([](const Tensor& x) { return max(x, {1}); }, distinct(gen, {3, 4, 2}));
  }
  SUBCASE("reduce_max over all dims") {
    check_unary([](const Tensor& x) { return max(x) * x; }, distinct(gen, {2, 3}));
  }
}

TEST_CASE("autodiff: ties split the gradient evenly") {
  Program f = trace("ties", [](Tensor x) {
    return NamedTensors{{"loss", max(x) + sum(relu(x))}};
  }, {{"x", {4}, DType::f64}});
  const auto out = interpret(value_and_grad(f, "loss", {"x"}), {{"x", Array({4}, std::vector<double>{3, 0, 3, -1})}});
  // max: 1/2 to each of the two 3s; relu = max(x, 0): 1 where x > 0, 1/2 at x == 0.
  CHECK(out.at("grad/x") == Array({4}, std::vector<double>{1.5, 0.5, 1.5, 0}));
}

TEST_CASE("autodiff: shape ops") {
  std::mt19937_64 gen(7);
  SUBCASE("broadcast_in_dim: new dims and a stretched size-1 dim") {
    check_unary([](const Tensor& x) { return broadcast_in_dim(x, {2, 3, 4}, {1, 2}); }, uniform(gen, {3, 1}));
  }
  SUBCASE("broadcast_in_dim: kept size-1 dim and a trailing new dim") {
    check_unary([](const Tensor& x) { return broadcast_in_dim(x, {1, 3, 2}, {0, 1}); }, uniform(gen, {1, 3}));
  }
  SUBCASE("broadcast_in_dim: scalar") {
    check_unary([](const Tensor& x) { return broadcast_to(x, {2, 3}); }, uniform(gen, {}));
  }
  SUBCASE("reshape") { check_unary([](const Tensor& x) { return reshape(x, {3, 2, 2}) * 2.0; }, uniform(gen, {4, 3})); }
  SUBCASE("transpose") {
    check_unary([](const Tensor& x) { return transpose(x, {2, 0, 1}); }, uniform(gen, {2, 3, 4}));
  }
  SUBCASE("slice") { check_unary([](const Tensor& x) { return slice(x, {1, 0}, {3, 2}); }, uniform(gen, {4, 3})); }
  SUBCASE("pad") { check_unary([](const Tensor& x) { return pad(x, {1, 0}, {2, 3}); }, uniform(gen, {2, 3})); }
  SUBCASE("concatenate, one operand twice") {
    check_binary([](const Tensor& x, const Tensor& y) { return concatenate({x, y, x}, 1); }, uniform(gen, {2, 3}),
                 uniform(gen, {2, 1}));
  }
}

TEST_CASE("autodiff: gather and scatter_add with repeated indices") {
  std::mt19937_64 gen(8);
  SUBCASE("gather") {
    check_grad([](const std::vector<Tensor>& xs) { return tanh(gather(xs[0], xs[1])); },
               {f64("table", {5, 3}), {"ids", {2, 3}, DType::i32}},
               {{"table", uniform(gen, {5, 3})}, {"ids", indices({2, 3}, {1, 3, 1, 0, 1, 4})}});
  }
  SUBCASE("scatter_add") {
    check_grad([](const std::vector<Tensor>& xs) { return exp(scatter_add(xs[1], xs[0], {5, 3})); },
               {f64("updates", {4, 3}), {"ids", {4}, DType::i32}},
               {{"updates", uniform(gen, {4, 3})}, {"ids", indices({4}, {2, 0, 2, 2})}});
  }
}

// A convolution computed directly from its definition (ConvDims in ir/op.hpp), in f64.
Array conv_reference(const Array& x, const Array& w, const ConvDims& c, const std::vector<std::int64_t>& lo, const Shape& out) {
  const std::size_t spatial = x.shape().size() - 2;
  const std::int64_t C = x.shape().back(), O = w.shape().back(), Cg = C / c.feature_groups, Og = O / c.feature_groups;
  Array r({out, DType::f64});
  std::vector<std::int64_t> p(spatial), k(spatial), q(spatial);
  for (std::int64_t i = 0; i < r.size(); ++i) {
    std::int64_t rest = i;
    const std::int64_t o = rest % O;
    rest /= O;
    for (std::size_t d = spatial; d-- > 0;) p[d] = rest % out[d + 1], rest /= out[d + 1];
    const std::int64_t n = rest;
    double sum = 0;
    const std::int64_t taps = w.size() / (Cg * O), group = o / Og;
    for (std::int64_t t = 0; t < taps; ++t) {
      std::int64_t left = t;
      for (std::size_t d = spatial; d-- > 0;) k[d] = left % w.shape()[d], left /= w.shape()[d];
      bool inside = true;
      std::int64_t at = n;
      for (std::size_t d = 0; d < spatial; ++d) {
        const std::int64_t tap = c.flip ? w.shape()[d] - 1 - k[d] : k[d];
        const std::int64_t dilated = p[d] * c.strides[d] + tap * c.rhs_dilation[d] - lo[d];
        inside = inside && dilated >= 0 && dilated % c.lhs_dilation[d] == 0 && dilated / c.lhs_dilation[d] < x.shape()[d + 1];
        at = at * x.shape()[d + 1] + (inside ? dilated / c.lhs_dilation[d] : 0);
      }
      if (!inside) continue;
      for (std::int64_t ch = 0; ch < Cg; ++ch) sum += x.at(at * C + group * Cg + ch) * w.at((t * Cg + ch) * O + o);
    }
    r.set(i, sum);
  }
  return r;
}

TEST_CASE("convolution: strides, padding (negative too), both dilations, a flipped window and feature groups, against the definition") {
  std::mt19937_64 gen(12);
  struct Case {
    Shape x, w;
    ConvDims dims;
    std::vector<std::int64_t> lo, hi;
  };
  const std::vector<Case> cases = {
      {{2, 5, 6, 3}, {3, 2, 3, 4}, {{2, 1}, {1, 1}, {1, 2}}, {1, 0}, {1, 2}},
      {{3, 7, 2}, {2, 2, 5}, {{3}, {1}, {1}}, {2}, {0}},
      {{1, 4, 4, 2}, {2, 2, 2, 3}, {{1, 2}, {2, 3}, {1, 1}, true}, {1, 0}, {-1, 2}},
      {{2, 3, 3, 1}, {3, 3, 1, 2}, {{1, 1}, {1, 1}, {1, 1}}, {1, 1}, {1, 1}},
      {{2, 5, 4, 6}, {3, 2, 2, 9}, {{2, 1}, {1, 1}, {1, 1}, false, 3}, {1, 0}, {1, 1}},    // 3 groups of 2 -> 3
      {{1, 6, 5, 4}, {3, 3, 1, 8}, {{1, 1}, {1, 2}, {2, 1}, true, 4}, {2, 1}, {2, -1}},   // depthwise, x2 outputs
  };
  for (const auto& k : cases) {
    CAPTURE(to_string(k.x));
    const Program f = trace(
        "conv", [&](Tensor x, Tensor w) { return conv_general(x, w, k.dims, k.lo, k.hi); },
        {f64("x", k.x), f64("w", k.w)});
    const NamedArrays in{{"x", uniform(gen, k.x)}, {"w", uniform(gen, k.w)}};
    const Array got = interpret(f, in).begin()->second;
    const Array expect = conv_reference(in.at("x"), in.at("w"), k.dims, k.lo, got.shape());
    for (std::int64_t i = 0; i < got.size(); ++i) CHECK(got.at(i) == doctest::Approx(expect.at(i)).epsilon(1e-12));
  }
  // f32 through the same kernel, and the TensorFlow spelling: 'same' padding keeps the size at stride 1.
  const Program same = trace("same", [](Tensor x, Tensor w) { return conv(x, w, {.padding_low = {1, 1}, .padding_high = {1, 1}}); },
                             {{"x", {2, 5, 4, 3}}, {"w", {3, 3, 3, 6}}});
  CHECK(same.type(same.outputs().at(0).value) == TensorType{{2, 5, 4, 6}, DType::f32});
}

TEST_CASE("autodiff: convolution") {
  std::mt19937_64 gen(13);
  auto check_conv = [&](Shape xs, Shape ws, ConvWindow window) {
    CAPTURE(to_string(xs));
    check_binary([&](const Tensor& x, const Tensor& w) { return conv(x, w, window); }, uniform(gen, xs), uniform(gen, ws));
  };
  SUBCASE("stride 1, same padding") { check_conv({2, 4, 5, 3}, {3, 3, 3, 2}, {.padding_low = {1, 1}, .padding_high = {1, 1}}); }
  SUBCASE("strides, odd sizes, padding that crops the gradient") {
    check_conv({2, 6, 5, 2}, {3, 2, 2, 3}, {.strides = {2, 3}, .padding_low = {1, 0}, .padding_high = {0, 2}});
  }
  SUBCASE("dilation and a stride larger than the window") {
    check_conv({1, 7, 3}, {2, 3, 2}, {.strides = {3}, .padding_low = {2}, .padding_high = {0}, .dilation = {2}});
  }
  SUBCASE("valid padding, 3 spatial dims") { check_conv({1, 3, 4, 3, 2}, {2, 3, 2, 2, 2}, {}); }
  SUBCASE("feature groups, strided") {
    check_conv({2, 5, 4, 6}, {3, 2, 3, 4},
               {.strides = {2, 1}, .padding_low = {1, 0}, .padding_high = {1, 1}, .feature_groups = 2});
  }
  SUBCASE("depthwise, dilated") {
    check_conv({1, 6, 4}, {3, 1, 8}, {.padding_low = {2}, .padding_high = {2}, .dilation = {2}, .feature_groups = 4});
  }
}

// A window sum or max computed directly from its definition (WindowDims in ir/op.hpp), in f64.
Array window_reference(const Array& x, bool take_max, const WindowDims& w, const std::vector<std::int64_t>& lo, const Shape& out) {
  const std::size_t rank = x.shape().size();
  Array r({out, DType::f64});
  std::vector<std::int64_t> p(rank), k(rank);
  for (std::int64_t i = 0; i < r.size(); ++i) {
    std::int64_t rest = i;
    for (std::size_t d = rank; d-- > 0;) p[d] = rest % out[d], rest /= out[d];
    double acc = take_max ? -std::numeric_limits<double>::infinity() : 0.0;
    for (std::int64_t t = 0; t < num_elements(w.window); ++t) {
      std::int64_t left = t, at = 0;
      for (std::size_t d = rank; d-- > 0;) k[d] = left % w.window[d], left /= w.window[d];
      bool inside = true;
      for (std::size_t d = 0; d < rank; ++d) {
        const std::int64_t q = p[d] * w.strides[d] + k[d] * w.window_dilation[d] - lo[d];
        inside = inside && q >= 0 && q % w.base_dilation[d] == 0 && q / w.base_dilation[d] < x.shape()[d];
        at = at * x.shape()[d] + (inside ? q / w.base_dilation[d] : 0);
      }
      if (inside) acc = take_max ? std::max(acc, x.at(at)) : acc + x.at(at);
    }
    r.set(i, acc);
  }
  return r;
}

TEST_CASE("reduce_window: sums and maxima over strided, padded (negative too) and dilated windows, against the definition") {
  std::mt19937_64 gen(21);
  struct Case {
    Shape x;
    WindowDims w;
    std::vector<std::int64_t> lo, hi;
  };
  const std::vector<Case> cases = {
      {{2, 5, 6, 3}, {{1, 3, 2, 1}, {1, 2, 1, 1}, {1, 1, 1, 1}, {1, 1, 2, 1}}, {0, 1, 0, 0}, {0, 1, 1, 0}},
      {{7, 4}, {{3, 2}, {2, 2}, {1, 1}, {1, 1}}, {-1, 0}, {2, 0}},
      {{1, 4, 4, 2}, {{1, 2, 2, 1}, {1, 1, 1, 1}, {1, 2, 1, 1}, {1, 1, 2, 1}}, {0, 0, 1, 0}, {0, 1, 0, 0}},
  };
  for (const auto& k : cases)
    for (OpKind kind : {OpKind::reduce_window_sum, OpKind::reduce_window_max}) {
      CAPTURE(to_string(k.x));
      CAPTURE(name_of(kind));
      const Program f = trace("pool", [&](Tensor x) { return reduce_window(x, kind, k.w, k.lo, k.hi); }, {f64("x", k.x)});
      const NamedArrays in{{"x", uniform(gen, k.x)}};
      const Array got = interpret(f, in).begin()->second;
      const Array expect = window_reference(in.at("x"), kind == OpKind::reduce_window_max, k.w, k.lo, got.shape());
      for (std::int64_t i = 0; i < got.size(); ++i) CHECK(got.at(i) == doctest::Approx(expect.at(i)).epsilon(1e-12));
    }
  // nn's pools over non-overlapping 2x2 windows of NHWC: the max and the mean of each block.
  const Program pools = trace(
      "pools",
      [](Tensor x) {
        const Tensor blocks = reshape(x, {2, 2, 2, 3, 2, 3});  // [N, H/2, 2, W/2, 2, C]
        return NamedTensors{{"max", nn::max_pool(x, {2, 2}) - max(blocks, {2, 4})},
                            {"avg", nn::avg_pool(x, {2, 2}) - sum(blocks, {2, 4}) * 0.25}};
      },
      {f64("x", {2, 4, 6, 3})});
  const NamedArrays diff = interpret(pools, {{"x", uniform(gen, {2, 4, 6, 3})}});
  for (const auto& [name, d] : diff)
    for (std::int64_t i = 0; i < d.size(); ++i) CHECK(std::abs(d.at(i)) < 1e-15);
}

TEST_CASE("autodiff: pooling (window sums and maxima)") {
  std::mt19937_64 gen(22);
  auto check_pool = [&](OpKind kind, Shape xs, WindowDims w, std::vector<std::int64_t> lo, std::vector<std::int64_t> hi) {
    CAPTURE(to_string(xs));
    CAPTURE(name_of(kind));
    // distinct values: no ties between a window's candidates for its maximum
    check_unary([&](const Tensor& x) { return reduce_window(x, kind, w, lo, hi); }, distinct(gen, xs));
  };
  for (OpKind kind : {OpKind::reduce_window_sum, OpKind::reduce_window_max}) {
    // non-overlapping 2x2; overlapping 3x3 at stride 2, padded, odd sizes; a dilated window, a stride larger
    // than it, cropping
    check_pool(kind, {2, 4, 4, 3}, {{1, 2, 2, 1}, {1, 2, 2, 1}, {1, 1, 1, 1}, {1, 1, 1, 1}}, {0, 0, 0, 0}, {0, 0, 0, 0});
    check_pool(kind, {1, 5, 6, 2}, {{1, 3, 3, 1}, {1, 2, 2, 1}, {1, 1, 1, 1}, {1, 1, 1, 1}}, {0, 1, 1, 0}, {0, 1, 0, 0});
    check_pool(kind, {2, 9, 2}, {{1, 2, 1}, {1, 3, 1}, {1, 1, 1}, {1, 2, 1}}, {0, -1, 0}, {0, 1, 0});
  }
  check_unary([](const Tensor& x) { return nn::avg_pool(x, {2, 3}, 1); }, uniform(gen, {1, 4, 5, 2}));
}

TEST_CASE("autodiff: composite functions") {
  std::mt19937_64 gen(9);
  SUBCASE("softmax") { check_unary([](const Tensor& x) { return softmax(x); }, uniform(gen, {3, 4}, -2, 2)); }
  SUBCASE("softmax, along dim 1 of 3") {
    check_unary([](const Tensor& x) { return softmax(x, 1); }, uniform(gen, {2, 3, 4}, -2, 2));
  }
  SUBCASE("log_softmax, along dim 0") {
    check_unary([](const Tensor& x) { return log_softmax(x, 0); }, uniform(gen, {3, 4}, -2, 2));
  }
  SUBCASE("gelu") { check_unary([](const Tensor& x) { return gelu(x); }, uniform(gen, {2, 5}, -3, 3)); }
  SUBCASE("sigmoid") { check_unary([](const Tensor& x) { return sigmoid(x); }, uniform(gen, {2, 5}, -3, 3)); }
  SUBCASE("layer_norm") {
    check_grad([](const std::vector<Tensor>& xs) { return layer_norm(xs[0], xs[1], xs[2]); },
               {f64("x", {3, 5}), f64("gamma", {5}), f64("beta", {5})},
               {{"x", uniform(gen, {3, 5})}, {"gamma", uniform(gen, {5})}, {"beta", uniform(gen, {5})}});
  }
  SUBCASE("cross_entropy") {
    check_grad([](const std::vector<Tensor>& xs) { return cross_entropy(xs[0], xs[1]); },
               {f64("logits", {4, 5}), {"labels", {4}, DType::i32}},
               {{"logits", uniform(gen, {4, 5}, -2, 2)}, {"labels", indices({4}, {0, 4, 2, 4})}});
  }
  SUBCASE("mse") {
    check_binary([](const Tensor& x, const Tensor& y) { return mse(x, y); }, uniform(gen, {3, 4}),
                 uniform(gen, {3, 4}));
  }
  SUBCASE("rms_norm (its rule)") {
    check_grad([](const std::vector<Tensor>& xs) { return rms_norm(xs[0], xs[1]); }, {f64("x", {3, 5}), f64("w", {5})},
               {{"x", uniform(gen, {3, 5})}, {"w", uniform(gen, {5})}});
  }
  SUBCASE("silu") { check_unary([](const Tensor& x) { return silu(x); }, uniform(gen, {2, 5}, -3, 3)); }
  // Llama's blocks (dsl/llama.hpp), parameters included.
  SUBCASE("rotary") { check_unary([](const Tensor& x) { return nn::rotary(x, 100.0); }, uniform(gen, {2, 3, 2, 4})); }
  SUBCASE("swiglu") {
    check_unary([](const Tensor& x) { return nn::SwiGlu{"mlp", 4, 6}(x); }, uniform(gen, {2, 3, 4}));
  }
  SUBCASE("grouped-query attention, 4 heads on 2 K/V heads") {
    check_unary([](const Tensor& x) { return nn::GroupedQueryAttention{"attn", 8, 4, 2, 100.0}(x); },
                uniform(gen, {2, 3, 8}));
  }
  SUBCASE("mlp, parameters included") {
    check_grad([](const std::vector<Tensor>& xs) { return mse(nn::Mlp{"mlp", {3, 4, 2}}(xs[0]), xs[1]); },
               {f64("x", {5, 3}), f64("y", {5, 2})}, {{"x", uniform(gen, {5, 3})}, {"y", uniform(gen, {5, 2})}});
  }
}

// softmax, log_softmax and layer_norm's normalization differentiate by their rule (autodiff/grad.hpp): the
// backward pass reads their result and layer_norm's 1 / sigma, none of their other inner values (which the
// VJPs of their ops would keep alive until the backward pass: f32 copies under mixed precision). In 16 bits
// too, where the rule reads the rounded result; the gradient is what the ops' own VJPs give, within bf16.
TEST_CASE("grad: composites differentiate by their rule and keep no inner value for the backward pass") {
  std::mt19937_64 gen(31);
  auto model = [](const std::vector<Tensor>& xs) {
    const Tensor x = xs[0];
    const Tensor probs = softmax(x, 1), logp = log_softmax(x), normed = layer_norm(x, xs[1], xs[2]);
    return sum(convert(probs * normed + logp, DType::f32) * convert(xs[3], DType::f32));
  };
  for (DType t : {DType::f32, DType::bf16}) {
    CAPTURE(name_of(t));
    const std::vector<InputSpec> specs{{"x", {4, 6}, t}, {"gamma", {6}, t}, {"beta", {6}, t}, {"r", {4, 6}, t}};
    const Program forward = trace("f", [&](const std::vector<Tensor>& xs) { return NamedTensors{{"loss", model(xs)}}; }, specs);
    REQUIRE(forward.composites().size() == 3);
    const Program with_grad = value_and_grad(forward, "loss", {"x", "gamma"});
    verify(with_grad);
    for (const auto& [root, c] : forward.composites())
      for (ValueId u = *with_grad.backward_start(); u < with_grad.size(); ++u)
        for (auto v : with_grad.op(u).operands) {
          INFO("backward op %" << u << " reads %" << v << " of the composite ending at %" << root);
          CHECK((v < c.first || v >= root || v == c.saved));
        }
    // The same program whose composites have an inner value as an output: differentiated op by op.
    Program op_by_op = forward;
    for (const auto& [root, c] : forward.composites()) op_by_op.add_output("inner%" + std::to_string(root), root - 1);
    const Program reference = value_and_grad(op_by_op, "loss", {"x", "gamma"});
    bool reads_inner = false;
    for (ValueId u = *reference.backward_start(); u < reference.size(); ++u)
      for (auto v : reference.op(u).operands)
        for (const auto& [root, c] : forward.composites()) reads_inner |= v >= c.first && v < root && v != c.saved;
    CHECK(reads_inner);
    NamedArrays in;
    for (const auto& s : specs) {
      const Array values = uniform(gen, s.shape, -2, 2);
      Array a({s.shape, t});
      for (std::int64_t i = 0; i < a.size(); ++i) a.set(i, values.at(i));
      in.emplace(s.name, std::move(a));
    }
    const NamedArrays got = interpret(with_grad, in), want = interpret(reference, in);
    for (const char* g : {"grad/x", "grad/gamma"}) {
      INFO(g);
      const Array &a = got.at(g), &b = want.at(g);
      for (std::int64_t i = 0; i < a.size(); ++i)
        CHECK(std::abs(a.at(i) - b.at(i)) <= (t == DType::f32 ? 1e-5 : 0.05) * (1 + std::abs(b.at(i))));
    }
  }
}

TEST_CASE("grad: only the ops between wrt and the loss are differentiated") {
  Program p("paths");
  Tensor x{p, p.add_input("x", {{3}, DType::f64})}, c{p, p.add_input("c", {{3}, DType::f64})};
  Tensor unused{p, p.add_input("unused", {{3}, DType::f64})};
  Tensor hidden = exp(x);
  Tensor loss = sum(hidden * tanh(c));  // tanh(c) does not depend on x: no backward op for it
  Tensor side = exp(unused);
  p.add_output("side", side.id());
  const auto before = p.size();
  const auto grads = grad(p, loss.id(), {x.id(), unused.id(), hidden.id(), loss.id()});
  for (ValueId v = before; v < p.size(); ++v) {
    CHECK(p.op(v).kind != OpKind::tanh);
    for (auto o : p.op(v).operands) CHECK((o != c.id() && o != unused.id() && o != side.id()));
  }
  p.add_output("gx", grads[0]);
  p.add_output("gu", grads[1]);
  p.add_output("gh", grads[2]);
  p.add_output("gl", grads[3]);
  verify(p);
  const std::vector<double> xv{0, 1, -1}, cv{1, 2, 3};
  const auto out = interpret(p, {{"x", Array({3}, xv)}, {"c", Array({3}, cv)},
                                 {"unused", Array({3}, std::vector<double>{5, 5, 5})}});
  for (std::int64_t i = 0; i < 3; ++i) {
    const auto u = static_cast<std::size_t>(i);
    const double t = std::tanh(cv[u]), e = std::exp(xv[u]);
    CHECK(out.at("gx").at(i) == doctest::Approx(e * t).epsilon(1e-12));
    CHECK(out.at("gh").at(i) == doctest::Approx(t).epsilon(1e-12));
    CHECK(out.at("gu").at(i) == 0);
  }
  CHECK(out.at("gl").at(0) == 1);
}

TEST_CASE("value_and_grad: defaults to every parameter, keeps the outputs") {
  Program f = trace("lin", [](Tensor x) {
    Tensor w = param("w", {2}, ones_init()), b = param("b", {2}, zeros_init());
    return NamedTensors{{"loss", sum(x * w + b)}, {"twice", x * 2.0}};
  }, {{"x", {2}}});
  Program g = value_and_grad(f, "loss");
  std::vector<std::string> names;
  for (const auto& o : g.outputs()) names.push_back(o.name);
  CHECK(names == std::vector<std::string>{"loss", "twice", "grad/w", "grad/b"});
  const auto out = interpret(g, {{"x", Array({2}, std::vector<float>{3, 4})},
                                 {"w", Array({2}, std::vector<float>{1, 1})},
                                 {"b", Array({2}, std::vector<float>{0, 0})}});
  CHECK(out.at("grad/w") == Array({2}, std::vector<float>{3, 4}));
  CHECK(out.at("grad/b") == Array({2}, std::vector<float>{1, 1}));
}

TEST_CASE("autodiff diagnostics") {
  Program f = trace("f", [](Tensor x, Tensor n) {
    return NamedTensors{{"loss", sum(x)}, {"y", x * 2.0}, {"n", n}};
  }, {{"x", {4}}, {"n", {4}, DType::i32}});
  auto fails_with = [](auto&& fn, const std::string& message) {
    try {
      fn();
      FAIL("expected a UserError: " << message);
    } catch (const UserError& e) {
      CHECK(std::string(e.what()) == message);
    }
  };
  fails_with([&] { value_and_grad(f, "y", {"x"}); },
             "value_and_grad: output 'y' must be a scalar floating-point value, got f32[4]");
  fails_with([&] { value_and_grad(f, "n", {"x"}); },
             "value_and_grad: output 'n' must be a scalar floating-point value, got i32[4]");
  fails_with([&] { value_and_grad(f, "los", {"x"}); }, "value_and_grad: program 'f' has no output named 'los'");
  fails_with([&] { value_and_grad(f, "loss", {"x", "params/w"}); },
             "value_and_grad: program 'f' has no input named 'params/w'");
  fails_with([&] { value_and_grad(f, "loss", {"n"}); },
             "grad: cannot differentiate with respect to n i32[4]: only floating-point values have gradients");
  Program p = f;
  fails_with([&] { grad(p, p.output("y"), {p.input("x")}); },
             "grad: loss %5 must be a scalar floating-point value, got f32[4]");
  fails_with([&] { grad(p, 99, {}); }, "grad: loss %99 is not defined in program 'f'");
  fails_with([&] { train_step([](Tensor x) { return sum(x); }, SGD{}, {{"x", {4}}}); },
             "train_step 'train_step': the loss function declares no parameters (see param() and nn)");
  fails_with([&] { train_step([](Tensor x) { return x * param("w", {4}, ones_init()); }, SGD{}, {{"x", {4}}}); },
             "train_step 'train_step': the loss must be a scalar floating-point value, got f32[4]");
}

namespace {
// loss(w) = sum(k * (w - t)^2), so dloss/dw = 2 k (w - t).
const std::vector<double> k_coef{1, 2, 3}, target{0.5, -1, 2}, w0{1, 0.25, -0.5};

Tensor quadratic() {
  Tensor w = param("w", {3}, zeros_init(), DType::f64);
  Program& p = w.program();
  Tensor d = w - constant(p, target, {3}, DType::f64);
  return sum(constant(p, k_coef, {3}, DType::f64) * d * d);
}

// Runs `steps` steps of a train step from `state`, feeding every updating output back into its input.
std::vector<NamedArrays> run_steps(const Program& step, NamedArrays state, int steps) {
  std::vector<NamedArrays> outs;
  for (int i = 0; i < steps; ++i) {
    outs.push_back(interpret(step, state));
    for (const auto& o : step.outputs())
      if (!o.updates.empty()) state.at(o.updates) = outs.back().at(o.name);
  }
  return outs;
}
}  // namespace

TEST_CASE("optimizer: SGD step by hand") {
  const double lr = 0.1;
  Program step = train_step(quadratic, SGD{lr}, {});
  std::vector<std::string> names;
  for (const auto& o : step.outputs()) names.push_back(o.name + "<-" + o.updates);
  CHECK(names == std::vector<std::string>{"loss<-", "w<-w"});
  const auto outs = run_steps(step, {{"w", Array({3}, w0)}}, 2);
  std::vector<double> w = w0;
  for (const auto& out : outs) {
    for (std::size_t i = 0; i < 3; ++i) w[i] -= lr * 2 * k_coef[i] * (w[i] - target[i]);
    for (std::size_t i = 0; i < 3; ++i)
      CHECK(out.at("w").at(static_cast<std::int64_t>(i)) == doctest::Approx(w[i]).epsilon(1e-14));
  }
}

TEST_CASE("optimizer: two Adam steps by hand") {
  const Adam adam{0.1, 0.8, 0.9, 1e-8};
  Program step = train_step(quadratic, adam, {});
  std::vector<std::string> names;
  for (const auto& o : step.outputs()) names.push_back(o.name + "<-" + o.updates);
  CHECK(names == std::vector<std::string>{"loss<-", "w<-w", "opt/adam/step<-opt/adam/step",
                                          "opt/adam/m/w<-opt/adam/m/w", "opt/adam/v/w<-opt/adam/v/w"});
  NamedArrays state = init_inputs(step, 0);
  CHECK(state.at("opt/adam/step") == Array({}, std::vector<float>{0}));
  CHECK(state.at("opt/adam/m/w") == Array({3}, std::vector<double>{0, 0, 0}));
  state.at("w") = Array({3}, w0);
  const auto outs = run_steps(step, state, 2);

  std::vector<double> w = w0, m(3, 0), v(3, 0);
  for (int t = 1; t <= 2; ++t) {
    const auto& out = outs[static_cast<std::size_t>(t - 1)];
    double loss = 0;
    for (std::size_t i = 0; i < 3; ++i) {
      const double d = w[i] - target[i], g = 2 * k_coef[i] * d;
      loss += k_coef[i] * d * d;
      m[i] = adam.beta1 * m[i] + (1 - adam.beta1) * g;
      v[i] = adam.beta2 * v[i] + (1 - adam.beta2) * g * g;
      const double m_hat = m[i] / (1 - std::pow(adam.beta1, t)), v_hat = v[i] / (1 - std::pow(adam.beta2, t));
      w[i] -= adam.learning_rate * m_hat / (std::sqrt(v_hat) + adam.eps);
    }
    CAPTURE(t);
    CHECK(out.at("loss").at(0) == doctest::Approx(loss).epsilon(1e-12));
    CHECK(out.at("opt/adam/step").at(0) == t);
    for (std::int64_t i = 0; i < 3; ++i) {
      const auto u = static_cast<std::size_t>(i);
      CHECK(out.at("opt/adam/m/w").at(i) == doctest::Approx(m[u]).epsilon(1e-12));
      CHECK(out.at("opt/adam/v/w").at(i) == doctest::Approx(v[u]).epsilon(1e-12));
      CHECK(out.at("w").at(i) == doctest::Approx(w[u]).epsilon(1e-12));
    }
  }
}

TEST_CASE("train_step: an MLP learns") {
  nn::Mlp model{"params/mlp", {4, 16, 1}};
  auto loss_fn = [&](Tensor x, Tensor y) { return mse(model(x), y); };
  const std::int64_t batch = 32;
  std::mt19937_64 gen(11);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> xs(static_cast<std::size_t>(batch * 4)), ys(static_cast<std::size_t>(batch));
  for (auto& x : xs) x = u(gen);
  for (std::size_t b = 0; b < ys.size(); ++b)
    ys[b] = std::sin(2 * xs[4 * b]) + 0.5f * xs[4 * b + 1] * xs[4 * b + 2] - xs[4 * b + 3];
  const std::vector<InputSpec> data{{"x", {batch, 4}}, {"y", {batch, 1}}};

  auto final_over_first = [&](const Program& step) {
    NamedArrays state = init_inputs(step, 5);
    state.emplace("x", Array({batch, 4}, xs));
    state.emplace("y", Array({batch, 1}, ys));
    const auto outs = run_steps(step, state, 50);
    return outs.back().at("loss").at(0) / outs.front().at("loss").at(0);
  };
  SUBCASE("SGD") {
    Program step = train_step(loss_fn, SGD{0.1}, data);
    std::vector<std::string> names;
    for (const auto& o : step.outputs()) names.push_back(o.name);
    CHECK(names ==
          std::vector<std::string>{"loss", "params/mlp/w1", "params/mlp/b1", "params/mlp/w2", "params/mlp/b2"});
    CHECK(final_over_first(step) < 0.1);
  }
  SUBCASE("Adam") {
    Program step = train_step(loss_fn, Adam{1e-2}, data, "mlp_adam");
    CHECK(step.name() == "mlp_adam");
    CHECK(step.outputs().size() == 1 + 4 + 1 + 2 * 4);
    CHECK(final_over_first(step) < 0.1);
  }
}

// ---- the training recipe: AdamW, SGD with momentum, global-norm clipping, learning-rate schedules ----

namespace {
// loss = sum(k * (w - t)^2) + sum(c * (m - T)^2) over a vector w (no decay by default) and a matrix m.
const std::vector<double> c_coef{0.5, 1, 1.5, 2, 2.5, 3}, m_target{1, -1, 0.5, 0, 2, -2}, m0{0.3, 0.2, -0.1, 1, 1.5, -0.5};

Tensor two_params() {
  const Tensor q = quadratic();
  Tensor m = param("m", {2, 3}, zeros_init(), DType::f64);
  Program& p = m.program();
  Tensor d = m - constant(p, m_target, {2, 3}, DType::f64);
  return q + sum(constant(p, c_coef, {2, 3}, DType::f64) * d * d);
}

// The gradients of two_params at (w, m), concatenated: w's 3 then m's 6.
std::vector<double> two_params_grad(const std::vector<double>& x) {
  std::vector<double> g(9);
  for (std::size_t i = 0; i < 3; ++i) g[i] = 2 * k_coef[i] * (x[i] - target[i]);
  for (std::size_t i = 0; i < 6; ++i) g[3 + i] = 2 * c_coef[i] * (x[3 + i] - m_target[i]);
  return g;
}

// torch.nn.utils.clip_grad_norm_: scale by min(1, max / (norm + 1e-6)); returns the norm before.
double clip_by_hand(std::vector<double>& g, double max_norm) {
  double sq = 0;
  for (double x : g) sq += x * x;
  const double norm = std::sqrt(sq), coef = std::min(1.0, max_norm / (norm + 1e-6));
  for (double& x : g) x *= coef;
  return norm;
}

// Steps of `step` from (w0, m0) fed the scale of `schedule`; each step's outputs.
std::vector<NamedArrays> run_scheduled(const Program& step, const LRSchedule& schedule, int steps) {
  NamedArrays state = init_inputs(step, 0);
  state.at("w") = Array({3}, w0);
  state.at("m") = Array({2, 3}, m0);
  std::vector<NamedArrays> outs;
  for (int t = 0; t < steps; ++t) {
    state.insert_or_assign(StepOptions::lr_scale_name, Array({}, std::vector<double>{schedule.at(t)}));
    outs.push_back(interpret(step, state));
    for (const auto& o : step.outputs())
      if (!o.updates.empty()) state.at(o.updates) = outs.back().at(o.name);
  }
  return outs;
}

void check_params(const NamedArrays& out, const std::vector<double>& x, double tol) {
  for (std::int64_t i = 0; i < 3; ++i) CHECK(out.at("w").at(i) == doctest::Approx(x[static_cast<std::size_t>(i)]).epsilon(tol));
  for (std::int64_t i = 0; i < 6; ++i) CHECK(out.at("m").at(i) == doctest::Approx(x[static_cast<std::size_t>(3 + i)]).epsilon(tol));
}
}  // namespace

TEST_CASE("lr schedules: warmup, then cosine or linear decay, held at the end") {
  const LRSchedule s = LRSchedule::warmup(3).then_cosine(4, 0.1);
  const std::vector<double> expect{0.25, 0.5, 0.75, 1, 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI / 4)), 0.55,
                                   0.1 + 0.9 * 0.5 * (1 + std::cos(3 * M_PI / 4)), 0.1, 0.1};
  for (std::size_t t = 0; t < expect.size(); ++t) CHECK(s.at(static_cast<long>(t)) == doctest::Approx(expect[t]).epsilon(1e-15));
  CHECK(s.steps() == 7);
  CHECK(LRSchedule::parse("warmup_cosine", 3, 7, 0.1, "--lr-schedule") == s);
  const LRSchedule linear = LRSchedule::parse("linear", 0, 4, 0, "--lr-schedule");
  CHECK(linear == LRSchedule::constant().then_linear(4, 0));
  CHECK(linear.at(0) == 1);
  CHECK(linear.at(2) == 0.5);
  CHECK(linear.at(9) == 0);
  CHECK(LRSchedule::parse("warmup", 4, 10, 0, "--lr-schedule").at(9) == 1);
  CHECK(LRSchedule::constant().at(1000) == 1);
}

TEST_CASE("optimizer: AdamW with global-norm clipping and a warmup-cosine schedule, by hand") {
  const AdamW adamw{.learning_rate = 0.1, .beta1 = 0.8, .beta2 = 0.9, .eps = 1e-8, .weight_decay = 0.2};
  const LRSchedule schedule = LRSchedule::warmup(2).then_cosine(3, 0.1);
  StepOptions options;
  options.clip_norm = 2.0;  // the gradient norm starts near 9: clipped on every step
  options.scheduled_learning_rate = true;
  const Program step = train_step(two_params, adamw, {}, options);
  std::vector<std::string> names;
  for (const auto& o : step.outputs()) names.push_back(o.name);
  CHECK(names == std::vector<std::string>{"loss", "grad_norm", "w", "m", "opt/adam/step", "opt/adam/m/w",
                                          "opt/adam/v/w", "opt/adam/m/m", "opt/adam/v/m"});
  const auto outs = run_scheduled(step, schedule, 6);

  std::vector<double> x = w0, m(9, 0), v(9, 0);
  x.insert(x.end(), m0.begin(), m0.end());
  int clipped = 0;
  for (int t = 1; t <= 6; ++t) {
    std::vector<double> g = two_params_grad(x);
    const double norm = clip_by_hand(g, 2.0);
    clipped += norm > 2.0;
    const double lr = adamw.learning_rate * schedule.at(t - 1);
    for (std::size_t i = 0; i < 9; ++i) {
      if (i >= 3) x[i] *= 1 - lr * adamw.weight_decay;  // only the matrix decays
      m[i] = adamw.beta1 * m[i] + (1 - adamw.beta1) * g[i];
      v[i] = adamw.beta2 * v[i] + (1 - adamw.beta2) * g[i] * g[i];
      const double m_hat = m[i] / (1 - std::pow(adamw.beta1, t)), v_hat = v[i] / (1 - std::pow(adamw.beta2, t));
      x[i] -= lr * m_hat / (std::sqrt(v_hat) + adamw.eps);
    }
    CAPTURE(t);
    CHECK(outs[static_cast<std::size_t>(t - 1)].at("grad_norm").at(0) == doctest::Approx(norm).epsilon(1e-12));
    check_params(outs[static_cast<std::size_t>(t - 1)], x, 1e-12);
  }
  CHECK(clipped == 6);
}

TEST_CASE("optimizer: SGD with momentum, Nesterov and weight decay, clipped, by hand") {
  for (const bool nesterov : {false, true}) {
    CAPTURE(nesterov);
    const SGD sgd{.learning_rate = 0.05, .momentum = 0.9, .weight_decay = 0.1, .nesterov = nesterov};
    StepOptions options;
    options.clip_norm = 5.0;
    options.scheduled_learning_rate = true;
    const LRSchedule schedule = LRSchedule::constant().then_linear(4, 0.5);
    const Program step = train_step(two_params, sgd, {}, options);
    CHECK(step.find_input("opt/sgd/momentum/m"));
    const auto outs = run_scheduled(step, schedule, 4);
    std::vector<double> x = w0, b(9, 0);
    x.insert(x.end(), m0.begin(), m0.end());
    for (int t = 1; t <= 4; ++t) {
      std::vector<double> g = two_params_grad(x);
      clip_by_hand(g, 5.0);
      for (std::size_t i = 0; i < 9; ++i) {
        double d = g[i] + sgd.weight_decay * x[i];
        b[i] = sgd.momentum * b[i] + d;
        d = nesterov ? d + sgd.momentum * b[i] : b[i];
        x[i] -= sgd.learning_rate * schedule.at(t - 1) * d;
      }
      CAPTURE(t);
      check_params(outs[static_cast<std::size_t>(t - 1)], x, 1e-12);
    }
  }
}

TEST_CASE("optimizer: AdamW's decay selector picks the parameters that decay") {
  const Program step = train_step(two_params, AdamW{.learning_rate = 0.1, .weight_decay = 0.5, .decay = {"w"}}, {});
  NamedArrays state = init_inputs(step, 0);
  state.at("w") = Array({3}, target);  // at the minimum: zero gradient, so only decay moves w
  state.at("m") = Array({2, 3}, m_target);
  const NamedArrays out = interpret(step, state);
  for (std::int64_t i = 0; i < 3; ++i) CHECK(out.at("w").at(i) == doctest::Approx(target[static_cast<std::size_t>(i)] * 0.95));
  for (std::int64_t i = 0; i < 6; ++i) CHECK(out.at("m").at(i) == m_target[static_cast<std::size_t>(i)]);
}
