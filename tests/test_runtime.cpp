// Kernels, interpreter and initialization. Every kernel is checked against a naive reference written here
// with plain loops over multi-indices, on random shapes of rank 0..4 and on every dtype it supports.
#include <doctest/doctest.h>

#include <partir/partir.hpp>

#include <immintrin.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>

using namespace partir;

namespace {

using Rng = std::mt19937_64;
const DType all_dtypes[] = {DType::f32, DType::f64, DType::i32, DType::bf16, DType::f16};
const DType float_dtypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16};

std::int64_t rand_int(Rng& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

Shape random_shape(Rng& rng, std::int64_t rank, std::int64_t max_dim = 4) {
  Shape s;
  for (std::int64_t i = 0; i < rank; ++i) s.push_back(rand_int(rng, 1, max_dim));
  return s;
}

// Floats uniform in [lo, hi); i32 rounded to integers.
Array random_array(Rng& rng, const TensorType& t, double lo = -2, double hi = 2) {
  Array a(t);
  std::uniform_real_distribution<double> u(lo, hi);
  for (std::int64_t i = 0; i < a.size(); ++i) a.set(i, t.dtype == DType::i32 ? std::round(u(rng)) : u(rng));
  return a;
}

Shape unravel(std::int64_t flat, const Shape& shape) {
  Shape index(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return index;
}

std::int64_t ravel(const Shape& index, const Shape& shape) {
  std::int64_t flat = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + index[d];
  return flat;
}

// Runs a single op through interpret() on the given operands.
Array run(OpKind kind, const std::vector<Array>& args, const Attrs& attrs = {}) {
  Program p("t");
  std::vector<ValueId> ids;
  NamedArrays inputs;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string name = "a" + std::to_string(i);
    ids.push_back(p.add_input(name, args[i].type()));
    inputs.emplace(name, args[i]);
  }
  p.add_output("y", p.add(kind, ids, attrs));
  return interpret(p, inputs).at("y");
}

// 16-bit results are computed in f32 and rounded once, the reference in f64 and rounded once: they may differ
// by one unit in the last place, 2^-7 relative for bf16 (8 significant bits), 2^-10 for f16 (11).
double tolerance(DType t) {
  switch (t) {
    case DType::f32: return 1e-4;
    case DType::f64: return 1e-10;
    case DType::bf16: return 0x1p-7;
    case DType::f16: return 0x1p-10;
    case DType::i32: return 0;
  }
  return 0;
}

void check_close(const Array& got, const Array& want, const std::string& what) {
  INFO(what);
  REQUIRE(to_string(got.type()) == to_string(want.type()));
  const double tol = tolerance(want.dtype());
  for (std::int64_t i = 0; i < want.size(); ++i) {
    const double g = got.at(i), w = want.at(i);
    const bool same = std::isnan(w) ? std::isnan(g) : std::abs(g - w) <= tol * (1 + std::abs(w));
    if (!same) {
      FAIL_CHECK("element " << i << ": got " << g << ", want " << w);
      return;
    }
  }
}

std::string describe(const std::vector<Array>& args) {
  std::string s;
  for (const auto& a : args) s += to_string(a.type()) + " ";
  return s;
}

// Elementwise reference: want[i] = f(args[0][i], args[1][i], ...), in the result dtype.
Array map_ref(const TensorType& out, const std::vector<Array>& args, const std::function<double(std::vector<double>)>& f) {
  Array want(out);
  for (std::int64_t i = 0; i < want.size(); ++i) {
    std::vector<double> x;
    for (const auto& a : args) x.push_back(a.at(i));
    want.set(i, f(x));
  }
  return want;
}

}  // namespace

TEST_CASE("runtime: unary ops match <cmath> on every rank") {
  Rng rng(1);
  const std::vector<std::pair<OpKind, std::function<double(double)>>> ops{
      {OpKind::neg, [](double x) { return -x; }},
      {OpKind::exp, [](double x) { return std::exp(x); }},
      {OpKind::log, [](double x) { return std::log(x); }},
      {OpKind::tanh, [](double x) { return std::tanh(x); }},
      {OpKind::rsqrt, [](double x) { return 1 / std::sqrt(x); }},
      {OpKind::sqrt, [](double x) { return std::sqrt(x); }},
      {OpKind::abs, [](double x) { return std::abs(x); }},
  };
  for (const auto& [kind, f] : ops)
    for (DType dt : float_dtypes)
      for (std::int64_t rank = 0; rank <= 4; ++rank) {
        const bool positive = kind == OpKind::log || kind == OpKind::rsqrt || kind == OpKind::sqrt;
        // 37 elements and more: Eigen's vectorized loop and its scalar tail both run
        const TensorType t{rank == 1 ? Shape{37} : random_shape(rng, rank), dt};
        const Array x = random_array(rng, t, positive ? 0.1 : -3, 3);
        check_close(run(kind, {x}), map_ref(t, {x}, [&](auto v) { return f(v[0]); }),
                    std::string(name_of(kind)) + " " + to_string(t));
      }
}

TEST_CASE("runtime: binary ops match a loop") {
  Rng rng(2);
  const std::vector<std::pair<OpKind, std::function<double(double, double)>>> ops{
      {OpKind::add, [](double a, double b) { return a + b; }},
      {OpKind::sub, [](double a, double b) { return a - b; }},
      {OpKind::mul, [](double a, double b) { return a * b; }},
      {OpKind::div, [](double a, double b) { return a / b; }},
      {OpKind::max, [](double a, double b) { return std::max(a, b); }},
      {OpKind::min, [](double a, double b) { return std::min(a, b); }},
      {OpKind::pow, [](double a, double b) { return std::pow(a, b); }},
  };
  for (const auto& [kind, f] : ops)
    for (DType dt : float_dtypes)
      for (std::int64_t rank = 0; rank <= 4; ++rank) {
        const TensorType t{rank == 1 ? Shape{41} : random_shape(rng, rank), dt};
        const bool positive = kind == OpKind::pow || kind == OpKind::div;  // pow base > 0, divisor away from 0
        const Array a = random_array(rng, t, positive ? 0.5 : -3, 3), b = random_array(rng, t, positive ? 0.5 : -2, 2);
        check_close(run(kind, {a, b}), map_ref(t, {a, b}, [&](auto v) { return f(v[0], v[1]); }),
                    std::string(name_of(kind)) + " " + to_string(t));
      }
}

TEST_CASE("runtime: compare gives 1/0 in the operand dtype, i32 included") {
  Rng rng(3);
  const std::vector<std::pair<CompareDir, std::function<bool(double, double)>>> dirs{
      {CompareDir::eq, std::equal_to<double>()}, {CompareDir::ne, std::not_equal_to<double>()},
      {CompareDir::lt, std::less<double>()},     {CompareDir::le, std::less_equal<double>()},
      {CompareDir::gt, std::greater<double>()},  {CompareDir::ge, std::greater_equal<double>()},
  };
  for (const auto& [dir, f] : dirs)
    for (DType dt : all_dtypes)
      for (std::int64_t rank = 0; rank <= 4; ++rank) {
        const TensorType t{random_shape(rng, rank), dt};
        Array a = random_array(rng, t), b = random_array(rng, t);
        for (std::int64_t i = 0; i < a.size(); ++i) {  // small integers, so that ties occur
          a.set(i, std::round(a.at(i)));
          b.set(i, std::round(b.at(i)));
        }
        Attrs attrs;
        attrs.cmp = dir;
        check_close(run(OpKind::compare, {a, b}, attrs),
                    map_ref(t, {a, b}, [&](auto v) { return f(v[0], v[1]) ? 1.0 : 0.0; }),
                    std::string(name_of(dir)) + " " + to_string(t));
      }
}

TEST_CASE("runtime: select takes on_true where the mask is nonzero, for every mask and value dtype") {
  Rng rng(4);
  for (DType mask_dt : all_dtypes)
    for (DType dt : all_dtypes)
      for (std::int64_t rank = 0; rank <= 3; ++rank) {
        const Shape shape = random_shape(rng, rank);
        Array mask(TensorType{shape, mask_dt});
        for (std::int64_t i = 0; i < mask.size(); ++i) mask.set(i, static_cast<double>(rand_int(rng, -1, 2)) * rand_int(rng, 0, 1));
        const Array a = random_array(rng, {shape, dt}), b = random_array(rng, {shape, dt});
        check_close(run(OpKind::select, {mask, a, b}),
                    map_ref({shape, dt}, {mask, a, b}, [](auto v) { return v[0] != 0 ? v[1] : v[2]; }),
                    describe({mask, a, b}));
      }
}

TEST_CASE("runtime: convert between every pair of dtypes, truncating toward zero into i32") {
  Rng rng(5);
  for (DType from : all_dtypes)
    for (DType to : all_dtypes) {
      const TensorType t{{3, 7}, from};
      const Array x = random_array(rng, t, -5, 5);
      Attrs attrs;
      attrs.dtype = to;
      const Array want = map_ref({t.shape, to}, {x}, [&](auto v) {
        return to == DType::i32 ? std::trunc(v[0]) : to == DType::f32 ? static_cast<float>(v[0]) : v[0];
      });
      check_close(run(OpKind::convert, {x}, attrs), want, to_string(t) + " -> " + std::string(name_of(to)));
    }
}

namespace {
__attribute__((target("f16c"))) std::uint16_t hardware_f16(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
__attribute__((target("f16c"))) float hardware_f32(std::uint16_t h) { return _cvtsh_ss(h); }

// bf16 by definition: of the two bf16 values around a finite x, the nearer; at a tie, the even one.
std::uint16_t reference_bf16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16), hi = static_cast<std::uint16_t>(lo + 1);
  auto value = [](std::uint16_t b) {  // infinity stands where 2^128 would be
    return (b & 0x7fff) == 0x7f80 ? std::copysign(0x1p128, static_cast<double>(static_cast<float>(bf16::from_bits(b))))
                                  : static_cast<double>(static_cast<float>(bf16::from_bits(b)));
  };
  const double dlo = std::abs(value(lo) - x), dhi = std::abs(value(hi) - x);
  return dlo < dhi || (dlo == dhi && lo % 2 == 0) ? lo : hi;
}
}  // namespace

TEST_CASE("runtime: 16-bit conversions round to nearest even, overflow to inf, keep NaN and subnormals") {
  // f16 against the CPU's own F16C conversions: every f16 value back to f32, and a sweep of f32 bit
  // patterns (every sign, exponent and rounding case) to f16.
  const bool f16c = __builtin_cpu_supports("f16c");
  if (!f16c) MESSAGE("this CPU has no F16C: f16 is checked by the named cases only");
  for (std::uint32_t h = 0; f16c && h < 0x10000; ++h) {
    const float got = static_cast<float>(f16::from_bits(static_cast<std::uint16_t>(h))), want = hardware_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(want)) REQUIRE(std::isnan(got));
    else REQUIRE(std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(want));
  }
  long f16_wrong = 0, bf16_wrong = 0;
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4093) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(u));
    const std::uint16_t h = f16(x).bits, b = bf16(x).bits;
    if (std::isnan(x)) {
      f16_wrong += !std::isnan(static_cast<float>(f16::from_bits(h)));
      bf16_wrong += !std::isnan(static_cast<float>(bf16::from_bits(b))) || (b >> 15) != (u >> 31);
      continue;
    }
    if (f16c) f16_wrong += h != hardware_f16(x);
    bf16_wrong += b != (std::isinf(x) ? static_cast<std::uint16_t>(u >> 16) : reference_bf16(x));
  }
  CHECK(f16_wrong == 0);
  CHECK(bf16_wrong == 0);
  // Bulk conversions (kernels::convert_elements: sixteen at a time where the CPU has AVX-512) give the scalar
  // bits for every bf16 value widened and for the sweep of f32 patterns narrowed, NaNs included.
  std::vector<bf16> every(0x10000);
  for (std::uint32_t h = 0; h < 0x10000; ++h) every[h] = bf16::from_bits(static_cast<std::uint16_t>(h));
  std::vector<float> wide(every.size());
  kernels::convert_elements(every.data(), wide.data(), static_cast<std::int64_t>(every.size()));
  std::vector<float> sweep;
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4093)
    sweep.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(u)));
  std::vector<bf16> narrow(sweep.size() - 3);  // a length that leaves a scalar tail
  kernels::convert_elements(sweep.data(), narrow.data(), static_cast<std::int64_t>(narrow.size()));
  long bulk_wrong = 0;
  for (std::size_t h = 0; h < every.size(); ++h)
    bulk_wrong += std::bit_cast<std::uint32_t>(wide[h]) != std::bit_cast<std::uint32_t>(static_cast<float>(every[h]));
  for (std::size_t i = 0; i < narrow.size(); ++i) bulk_wrong += narrow[i] != bf16(sweep[i]);
  CHECK(bulk_wrong == 0);
  // The cases by name.
  CHECK(bf16(1.0f + 0x1p-8f).bits == bf16(1.0f).bits);                 // a tie goes to the even neighbour...
  CHECK(bf16(1.0f + 3 * 0x1p-8f) == bf16(1.0f + 0x1p-6f));             // ...upwards too
  CHECK(bf16(std::numeric_limits<float>::max()).bits == 0x7f80);       // rounds past bf16's largest: inf
  CHECK(bf16(-0.0f).bits == 0x8000);
  CHECK(bf16(0x1p-133f).bits == 0x0001);                                 // bf16's smallest subnormal
  CHECK(f16(65520.0f).bits == 0x7c00);                                   // halfway past 65504: inf
  CHECK(f16(65519.0f).bits == 0x7bff);
  CHECK(f16(0x1p-24f).bits == 0x0001);                                   // f16's smallest subnormal
  CHECK(f16(0x1p-25f).bits == 0x0000);                                   // a tie with zero: even
  CHECK(std::isnan(static_cast<float>(f16(std::numeric_limits<float>::quiet_NaN()))));
  // From f64 the rounding is one rounding, not f64 -> f32 -> 16 bits (which would see a tie here).
  Attrs to_bf16;
  to_bf16.dtype = DType::bf16;
  const Array x({3}, std::vector<double>{1 + 0x1p-8 + 0x1p-40, 1 + 0x1p-8, -(1 + 0x1p-8 + 0x1p-40)});
  const Array y = run(OpKind::convert, {x}, to_bf16);
  CHECK(y.at(0) == 1 + 0x1p-7);
  CHECK(y.at(1) == 1);
  CHECK(y.at(2) == -(1 + 0x1p-7));
}

TEST_CASE("runtime: constant splats one value or takes one per element") {
  Rng rng(6);
  for (DType dt : all_dtypes)
    for (std::int64_t rank = 0; rank <= 3; ++rank) {
      Attrs attrs;
      attrs.shape = random_shape(rng, rank);
      attrs.dtype = dt;
      attrs.literal = {2.0};
      const Array splat = run(OpKind::constant, {}, attrs);
      check_close(splat, map_ref({attrs.shape, dt}, {}, [](auto) { return 2.0; }), "splat");
      attrs.literal.clear();
      for (std::int64_t i = 0; i < num_elements(attrs.shape); ++i) attrs.literal.push_back(static_cast<double>(i) - 3);
      const Array each = run(OpKind::constant, {}, attrs);
      Array want(TensorType{attrs.shape, dt});
      for (std::int64_t i = 0; i < want.size(); ++i) want.set(i, static_cast<double>(i) - 3);
      check_close(each, want, "per element " + to_string(want.type()));
    }
}

namespace {

// dot_general by definition: for each result index, sum over every contracting index.
Array dot_ref(const Array& lhs, const Array& rhs, const DotDims& d) {
  const TensorType lt = lhs.type(), rt = rhs.type();
  const TensorType out_t = infer_type(OpKind::dot_general, std::vector<TensorType>{lt, rt}, [&] {
    Attrs a;
    a.dot = d;
    return a;
  }());
  auto free_dims = [](std::int64_t rank, const std::vector<std::int64_t>& b, const std::vector<std::int64_t>& c) {
    std::vector<std::int64_t> f;
    for (std::int64_t i = 0; i < rank; ++i)
      if (std::count(b.begin(), b.end(), i) + std::count(c.begin(), c.end(), i) == 0) f.push_back(i);
    return f;
  };
  const auto lf = free_dims(lt.rank(), d.lhs_batch, d.lhs_contract);
  const auto rf = free_dims(rt.rank(), d.rhs_batch, d.rhs_contract);
  Shape contract_shape;
  for (auto c : d.lhs_contract) contract_shape.push_back(lt.shape[c]);
  Array out(out_t);
  for (std::int64_t o = 0; o < out.size(); ++o) {
    const Shape oi = unravel(o, out_t.shape);
    Shape li(lt.shape.size()), ri(rt.shape.size());
    std::size_t k = 0;
    for (std::size_t b = 0; b < d.lhs_batch.size(); ++b, ++k) li[d.lhs_batch[b]] = ri[d.rhs_batch[b]] = oi[k];
    for (auto f : lf) li[f] = oi[k++];
    for (auto f : rf) ri[f] = oi[k++];
    double sum = 0;
    for (std::int64_t c = 0; c < num_elements(contract_shape); ++c) {
      const Shape ci = unravel(c, contract_shape);
      for (std::size_t j = 0; j < ci.size(); ++j) li[d.lhs_contract[j]] = ri[d.rhs_contract[j]] = ci[j];
      sum += lhs.at(ravel(li, lt.shape)) * rhs.at(ravel(ri, rt.shape));
    }
    out.set(o, sum);
  }
  return out;
}

struct DotCase {
  Shape lhs, rhs;
  DotDims dims;
};

// Random batch, contracting and free dims (0..2 of each), each operand's dims in a random order.
DotCase random_dot(Rng& rng, std::int64_t max_dim) {
  const auto nb = rand_int(rng, 0, 1), nc = rand_int(rng, 0, 2), nl = rand_int(rng, 0, 2), nr = rand_int(rng, 0, 2);
  const Shape batch = random_shape(rng, nb, max_dim), contract = random_shape(rng, nc, max_dim);
  DotCase c;
  c.dims.lhs_batch.resize(nb);
  c.dims.rhs_batch.resize(nb);
  c.dims.lhs_contract.resize(nc);
  c.dims.rhs_contract.resize(nc);
  // roles: (0, i) batch i, (1, i) contracting i, (2, i) free i
  auto build = [&](std::int64_t n_free, Shape& shape, std::vector<std::int64_t>& b, std::vector<std::int64_t>& k) {
    std::vector<std::pair<int, std::int64_t>> roles;
    for (std::int64_t i = 0; i < nb; ++i) roles.push_back({0, i});
    for (std::int64_t i = 0; i < nc; ++i) roles.push_back({1, i});
    for (std::int64_t i = 0; i < n_free; ++i) roles.push_back({2, i});
    std::shuffle(roles.begin(), roles.end(), rng);
    for (std::size_t pos = 0; pos < roles.size(); ++pos) {
      const auto [role, i] = roles[pos];
      if (role == 0) b[i] = static_cast<std::int64_t>(pos);
      if (role == 1) k[i] = static_cast<std::int64_t>(pos);
      shape.push_back(role == 0 ? batch[i] : role == 1 ? contract[i] : rand_int(rng, 1, max_dim));
    }
  };
  build(nl, c.lhs, c.dims.lhs_batch, c.dims.lhs_contract);
  build(nr, c.rhs, c.dims.rhs_batch, c.dims.rhs_contract);
  return c;
}

Array run_dot(const Array& lhs, const Array& rhs, const DotDims& d) {
  Attrs attrs;
  attrs.dot = d;
  return run(OpKind::dot_general, {lhs, rhs}, attrs);
}

int copies(const DotCase& c) {
  const auto plan = kernels::plan_dot(c.lhs, c.rhs, c.dims);
  return plan.lhs.transpose + plan.rhs.transpose;
}

}  // namespace

TEST_CASE("runtime: dot_general on random dim layouts matches the definition") {
  Rng rng(7);
  int mapped = 0, transposed = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const DotCase c = random_dot(rng, trial % 3 == 0 ? 9 : 4);
    (copies(c) == 0 ? mapped : transposed)++;
    for (DType dt : float_dtypes) {
      const Array lhs = random_array(rng, {c.lhs, dt}), rhs = random_array(rng, {c.rhs, dt});
      check_close(run_dot(lhs, rhs, c.dims), dot_ref(lhs, rhs, c.dims),
                  describe({lhs, rhs}) + "batch " + to_string(Shape(c.dims.lhs_batch)) + "x" +
                      to_string(Shape(c.dims.rhs_batch)) + " contract " + to_string(Shape(c.dims.lhs_contract)) +
                      "x" + to_string(Shape(c.dims.rhs_contract)));
    }
  }
  CHECK(mapped > 50);  // both the in-place and the transposing path ran many times
  CHECK(transposed > 50);
}

TEST_CASE("runtime: dot_general maps common layouts in place and transposes the rest (GEMM sizes)") {
  Rng rng(8);
  struct Case {
    const char* what;
    DotCase c;
    int copies;
  };
  const std::int64_t m = 37, k = 45, n = 29;
  const std::vector<Case> cases{
      {"[m,k]x[k,n]", {{m, k}, {k, n}, {{}, {}, {1}, {0}}}, 0},
      {"[k,m]x[k,n]", {{k, m}, {k, n}, {{}, {}, {0}, {0}}}, 0},
      {"[m,k]x[n,k]", {{m, k}, {n, k}, {{}, {}, {1}, {1}}}, 0},
      {"[k,m]x[n,k]", {{k, m}, {n, k}, {{}, {}, {0}, {1}}}, 0},
      {"matrix-vector", {{m, k}, {k}, {{}, {}, {1}, {0}}}, 0},
      {"vector-vector", {{k}, {k}, {{}, {}, {0}, {0}}}, 0},
      {"outer product", {{m}, {n}, {{}, {}, {}, {}}}, 0},
      {"batch leading", {{3, m, k}, {3, k, n}, {{0}, {0}, {2}, {1}}}, 0},
      {"attention scores [b,s,h,d]x[b,t,h,d]", {{2, 24, 3, 21}, {2, 26, 3, 21}, {{0, 2}, {0, 2}, {3}, {3}}}, 0},
      {"attention values [b,h,s,t]x[b,t,h,d]", {{2, 3, 24, 26}, {2, 26, 3, 21}, {{0, 1}, {0, 2}, {3}, {1}}}, 0},
      {"two contracting dims in order", {{m, 5, 7}, {5, 7, n}, {{}, {}, {1, 2}, {0, 1}}}, 0},
      {"two contracting dims listed out of order", {{m, 5, 7}, {5, 7, n}, {{}, {}, {2, 1}, {1, 0}}}, 0},
      {"contracting dims split by a free dim", {{5, m, 7}, {5, 7, n}, {{}, {}, {0, 2}, {0, 1}}}, 1},
      {"contracting dims paired crosswise", {{m, 5, 7}, {7, 5, n}, {{}, {}, {1, 2}, {1, 0}}}, 1},
      {"free dims split by the batch dim on both sides", {{4, 3, 5, 22}, {6, 3, 22, 4}, {{1}, {1}, {3}, {2}}}, 2},
  };
  for (const auto& tc : cases) {
    INFO(tc.what);
    CHECK(copies(tc.c) == tc.copies);
    for (DType dt : float_dtypes) {
      const Array lhs = random_array(rng, {tc.c.lhs, dt}), rhs = random_array(rng, {tc.c.rhs, dt});
      check_close(run_dot(lhs, rhs, tc.c.dims), dot_ref(lhs, rhs, tc.c.dims), tc.what);
    }
  }
}

TEST_CASE("runtime: dot_general rejects i32 operands") {
  Array a({2, 2}, std::vector<std::int32_t>{1, 2, 3, 4});
  CHECK_THROWS_WITH_AS(run_dot(a, a, {{}, {}, {1}, {0}}),
                       "interpret t: %2: dot_general: i32 operands are not supported, convert them to f32 or f64 first",
                       UserError);
}

TEST_CASE("runtime: reduce_sum and reduce_max over any subset of dims") {
  Rng rng(9);
  for (OpKind kind : {OpKind::reduce_sum, OpKind::reduce_max})
    for (DType dt : all_dtypes)
      for (std::int64_t rank = 0; rank <= 4; ++rank)
        for (int trial = 0; trial < 6; ++trial) {
          const TensorType t{random_shape(rng, rank, 5), dt};
          Attrs attrs;
          for (std::int64_t d = 0; d < rank; ++d)
            if (rand_int(rng, 0, 1)) attrs.dims.push_back(d);
          const Array x = random_array(rng, t, -9, 9);
          Shape kept;
          for (std::int64_t d = 0; d < rank; ++d)
            if (std::count(attrs.dims.begin(), attrs.dims.end(), d) == 0) kept.push_back(t.shape[d]);
          Array want(TensorType{kept, dt});
          std::vector<double> acc(static_cast<std::size_t>(want.size()), 0.0);  // exact: 16-bit sums round once
          std::vector<bool> seen(acc.size(), false);
          for (std::int64_t i = 0; i < x.size(); ++i) {
            const Shape xi = unravel(i, t.shape);
            Shape oi;
            for (std::int64_t d = 0; d < rank; ++d)
              if (std::count(attrs.dims.begin(), attrs.dims.end(), d) == 0) oi.push_back(xi[d]);
            const auto o = ravel(oi, kept);
            const double v = x.at(i);
            acc[o] = kind == OpKind::reduce_sum ? acc[o] + v : seen[o] ? std::max(acc[o], v) : v;
            seen[o] = true;
          }
          for (std::int64_t o = 0; o < want.size(); ++o) want.set(o, acc[o]);
          check_close(run(kind, {x}, attrs), want,
                      std::string(name_of(kind)) + " " + to_string(t) + " dims " + to_string(Shape(attrs.dims)));
        }
}

TEST_CASE("runtime: reducing an empty dim gives the identity") {
  Attrs attrs;
  attrs.dims = {1};
  const Array x(TensorType{{3, 0}, DType::f32});
  check_close(run(OpKind::reduce_sum, {x}, attrs), Array({3}, std::vector<float>(3, 0.f)), "sum");
  CHECK(run(OpKind::reduce_max, {x}, attrs).at(0) == -INFINITY);
}

namespace {

// broadcast_in_dim by definition: result index i reads operand index (i[dims[0]], i[dims[1]], ...), with
// size-1 operand dims read at 0.
Array broadcast_ref(const Array& x, const Attrs& a) {
  Array out(TensorType{a.shape, x.dtype()});
  for (std::int64_t i = 0; i < out.size(); ++i) {
    const Shape oi = unravel(i, a.shape);
    Shape xi;
    for (std::size_t d = 0; d < a.dims.size(); ++d) xi.push_back(x.shape()[d] == 1 ? 0 : oi[a.dims[d]]);
    out.set(i, x.at(ravel(xi, x.shape())));
  }
  return out;
}

}  // namespace

TEST_CASE("runtime: broadcast_in_dim, random and the bias fast paths") {
  Rng rng(10);
  for (DType dt : all_dtypes) {
    for (int trial = 0; trial < 40; ++trial) {
      Attrs attrs;
      attrs.shape = random_shape(rng, rand_int(rng, 0, 4));
      Shape xs;
      for (std::int64_t d = 0; d < static_cast<std::int64_t>(attrs.shape.size()); ++d)
        if (rand_int(rng, 0, 1)) {
          attrs.dims.push_back(d);
          xs.push_back(rand_int(rng, 0, 2) ? attrs.shape[d] : 1);
        }
      const Array x = random_array(rng, {xs, dt});
      check_close(run(OpKind::broadcast_in_dim, {x}, attrs), broadcast_ref(x, attrs),
                  to_string(x.type()) + " -> " + to_string(attrs.shape) + " dims " + to_string(Shape(attrs.dims)));
    }
    const std::vector<std::pair<Shape, std::vector<std::int64_t>>> fast{
        {{70}, {1}}, {{50}, {0}}, {{}, {}}, {{1, 70}, {0, 1}}, {{50, 1}, {0, 1}}};
    for (const auto& [xs, dims] : fast) {
      Attrs attrs;
      attrs.shape = {50, 70};
      attrs.dims = dims;
      const Array x = random_array(rng, {xs, dt});
      check_close(run(OpKind::broadcast_in_dim, {x}, attrs), broadcast_ref(x, attrs), to_string(x.type()));
    }
  }
}

TEST_CASE("runtime: reshape keeps the row-major element order") {
  Rng rng(11);
  for (DType dt : all_dtypes)
    for (std::int64_t rank = 0; rank <= 4; ++rank) {
      const TensorType t{random_shape(rng, rank), dt};
      Shape to = t.shape;
      std::shuffle(to.begin(), to.end(), rng);
      to.insert(to.begin(), 1);
      const Array x = random_array(rng, t);
      Attrs attrs;
      attrs.shape = to;
      const Array y = run(OpKind::reshape, {x}, attrs);
      CHECK(y.shape() == to);
      CHECK(y.storage() == x.storage());
    }
}

TEST_CASE("runtime: transpose by any permutation, tiled 2-D and 3-D cases included") {
  Rng rng(12);
  auto check = [&](const Array& x, const std::vector<std::int64_t>& perm) {
    Attrs attrs;
    attrs.dims = perm;
    Shape out_shape;
    for (auto p : perm) out_shape.push_back(x.shape()[p]);
    Array want(TensorType{out_shape, x.dtype()});
    for (std::int64_t i = 0; i < want.size(); ++i) {
      const Shape oi = unravel(i, out_shape);
      Shape xi(perm.size());
      for (std::size_t d = 0; d < perm.size(); ++d) xi[perm[d]] = oi[d];
      want.set(i, x.at(ravel(xi, x.shape())));
    }
    check_close(run(OpKind::transpose, {x}, attrs), want, to_string(x.type()) + " perm " + to_string(Shape(perm)));
  };
  for (DType dt : all_dtypes) {
    for (std::int64_t rank = 0; rank <= 4; ++rank)
      for (int trial = 0; trial < 5; ++trial) {
        std::vector<std::int64_t> perm(static_cast<std::size_t>(rank));
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        check(random_array(rng, {random_shape(rng, rank, 5), dt}), perm);
      }
    check(random_array(rng, {{70, 45}, dt}), {1, 0});
    check(random_array(rng, {{3, 40, 50}, dt}), {0, 2, 1});
    check(random_array(rng, {{3, 40, 50}, dt}), {2, 0, 1});
    check(random_array(rng, {{2, 33, 3, 8}, dt}), {0, 2, 1, 3});
  }
}

TEST_CASE("runtime: slice, pad and concatenate match index arithmetic") {
  Rng rng(13);
  for (DType dt : all_dtypes)
    for (std::int64_t rank = 1; rank <= 4; ++rank)
      for (int trial = 0; trial < 5; ++trial) {
        const TensorType t{random_shape(rng, rank, 5), dt};
        const Array x = random_array(rng, t);
        Attrs s, p;
        Shape sliced, padded;
        for (std::int64_t d = 0; d < rank; ++d) {
          s.lo.push_back(rand_int(rng, 0, t.shape[d]));
          s.hi.push_back(rand_int(rng, s.lo.back(), t.shape[d]));
          sliced.push_back(s.hi.back() - s.lo.back());
          p.lo.push_back(rand_int(rng, 0, 2));
          p.hi.push_back(rand_int(rng, 0, 2));
          padded.push_back(t.shape[d] + p.lo.back() + p.hi.back());
        }
        Array want_slice(TensorType{sliced, dt}), want_pad(TensorType{padded, dt});
        for (std::int64_t i = 0; i < want_slice.size(); ++i) {
          Shape xi = unravel(i, sliced);
          for (std::int64_t d = 0; d < rank; ++d) xi[d] += s.lo[d];
          want_slice.set(i, x.at(ravel(xi, t.shape)));
        }
        for (std::int64_t i = 0; i < x.size(); ++i) {
          Shape pi = unravel(i, t.shape);
          for (std::int64_t d = 0; d < rank; ++d) pi[d] += p.lo[d];
          want_pad.set(ravel(pi, padded), x.at(i));
        }
        check_close(run(OpKind::slice, {x}, s), want_slice, "slice " + to_string(t));
        check_close(run(OpKind::pad, {x}, p), want_pad, "pad " + to_string(t));

        Attrs c;
        c.axis = rand_int(rng, 0, rank - 1);
        std::vector<Array> parts{x};
        for (auto extra = rand_int(rng, 0, 2); extra > 0; --extra) {
          Shape shape = t.shape;
          shape[c.axis] = rand_int(rng, 0, 3);  // an empty part now and then
          parts.push_back(random_array(rng, {shape, dt}));
        }
        Shape joined = t.shape;
        joined[c.axis] = 0;
        for (const auto& part : parts) joined[c.axis] += part.shape()[c.axis];
        Array want_cat(TensorType{joined, dt});
        std::int64_t at = 0;
        for (const auto& part : parts) {
          for (std::int64_t i = 0; i < part.size(); ++i) {
            Shape ji = unravel(i, part.shape());
            ji[c.axis] += at;
            want_cat.set(ravel(ji, joined), part.at(i));
          }
          at += part.shape()[c.axis];
        }
        check_close(run(OpKind::concatenate, parts, c), want_cat, "concatenate " + describe(parts));
      }
}

TEST_CASE("runtime: gather rows and scatter_add them back, with repeated indices") {
  Rng rng(14);
  for (DType dt : all_dtypes)
    for (std::int64_t table_rank = 1; table_rank <= 3; ++table_rank)
      for (std::int64_t index_rank = 0; index_rank <= 2; ++index_rank) {
        const Shape table_shape = random_shape(rng, table_rank, 4);
        const std::int64_t rows = table_shape[0];
        const Shape feature(table_shape.begin() + 1, table_shape.end());
        const std::int64_t row = num_elements(feature);
        const Shape index_shape = random_shape(rng, index_rank, 5);
        Array indices(TensorType{index_shape, DType::i32});
        for (std::int64_t i = 0; i < indices.size(); ++i) indices.set(i, static_cast<double>(rand_int(rng, 0, rows - 1)));
        const Array table = random_array(rng, {table_shape, dt});

        Shape gathered = index_shape;
        gathered.insert(gathered.end(), feature.begin(), feature.end());
        Array want_gather(TensorType{gathered, dt});
        for (std::int64_t i = 0; i < indices.size(); ++i)
          for (std::int64_t f = 0; f < row; ++f)
            want_gather.set(i * row + f, table.at(static_cast<std::int64_t>(indices.at(i)) * row + f));
        check_close(run(OpKind::gather, {table, indices}), want_gather, "gather " + describe({table, indices}));

        const Array updates = random_array(rng, {gathered, dt});
        Array want_scatter(TensorType{table_shape, dt});
        for (std::int64_t i = 0; i < indices.size(); ++i)
          for (std::int64_t f = 0; f < row; ++f) {
            const auto o = static_cast<std::int64_t>(indices.at(i)) * row + f;
            want_scatter.set(o, want_scatter.at(o) + updates.at(i * row + f));
          }
        Attrs attrs;
        attrs.shape = table_shape;
        check_close(run(OpKind::scatter_add, {indices, updates}, attrs), want_scatter,
                    "scatter_add " + describe({indices, updates}));
      }
}

TEST_CASE("runtime: results do not depend on where the data sits in memory") {
  // Eigen would split dynamic-size work between vector and scalar code by address, and the two round
  // differently; a one-element shift moves every element to another offset within a vector.
  Rng rng(16);
  for (DType dt : float_dtypes) {
    INFO(name_of(dt));
    const Array x = random_array(rng, {{203}, dt}, 0.1, 3), y = random_array(rng, {{203}, dt}, 0.1, 3);
    Attrs tail;
    tail.lo = {1};
    tail.hi = {203};
    const Array x_tail = run(OpKind::slice, {x}, tail), y_tail = run(OpKind::slice, {y}, tail);
    for (OpKind kind : {OpKind::exp, OpKind::log, OpKind::tanh, OpKind::rsqrt, OpKind::sqrt}) {
      INFO(name_of(kind));
      CHECK(run(OpKind::slice, {run(kind, {x})}, tail) == run(kind, {x_tail}));
    }
    CHECK(run(OpKind::slice, {run(OpKind::pow, {x, y})}, tail) == run(OpKind::pow, {x_tail, y_tail}));

    // each row of a matrix sums as the same data alone
    const Array m = random_array(rng, {{7, 37}, dt});
    Attrs last;
    last.dims = {1};
    const Array sums = run(OpKind::reduce_sum, {m}, last);
    // each batch of a batched product (small: below Eigen's GEMM threshold) as the same product alone
    const Array lhs = random_array(rng, {{6, 3, 5}, dt}), rhs = random_array(rng, {{6, 5, 4}, dt});
    const DotDims batched{{0}, {0}, {2}, {1}};
    const Array products = run_dot(lhs, rhs, batched);
    auto slice = [](const Array& a, std::vector<std::int64_t> lo, std::vector<std::int64_t> hi) {
      Attrs attrs;
      attrs.lo = std::move(lo);
      attrs.hi = std::move(hi);
      return run(OpKind::slice, {a}, attrs);
    };
    for (std::int64_t r = 0; r < 7; ++r)
      CHECK(run(OpKind::reduce_sum, {slice(m, {r, 0}, {r + 1, 37})}, last).at(0) == sums.at(r));
    for (std::int64_t b = 0; b < 6; ++b)
      CHECK(run_dot(slice(lhs, {b, 0, 0}, {b + 1, 3, 5}), slice(rhs, {b, 0, 0}, {b + 1, 5, 4}), batched) ==
            slice(products, {b, 0, 0}, {b + 1, 3, 4}));
  }
}

TEST_CASE("interpret: an out-of-range gather index names the index and the table") {
  const Array table({5, 3}, std::vector<float>(15, 1.f));
  CHECK_THROWS_WITH_AS(run(OpKind::gather, {table, Array({3}, std::vector<std::int32_t>{0, 7, 1})}),
                       "interpret t: %2: gather: index 7 is out of range [0, 5) of table f32[5,3]", UserError);
  CHECK_THROWS_WITH_AS(run(OpKind::gather, {table, Array({1}, std::vector<std::int32_t>{-1})}),
                       "interpret t: %2: gather: index -1 is out of range [0, 5) of table f32[5,3]", UserError);
  Attrs attrs;
  attrs.shape = {4};
  CHECK_THROWS_WITH_AS(run(OpKind::scatter_add, {Array({1}, std::vector<std::int32_t>{4}), Array({1}, std::vector<float>{1.f})}, attrs),
                       "interpret t: %2: scatter_add: index 4 is out of range [0, 4) of result f32[4]", UserError);
}

TEST_CASE("interpret: inputs must match the program exactly") {
  Program p("main");
  auto x = p.add_input("x", {{8, 4}});
  p.add_output("y", p.add(OpKind::neg, {x}));
  const Array good(TensorType{{8, 4}, DType::f32});
  CHECK_THROWS_WITH_AS(interpret(p, {}), "interpret main: missing input 'x'", UserError);
  CHECK_THROWS_WITH_AS(interpret(p, {{"x", Array(TensorType{{8, 5}, DType::f32})}}),
                       "interpret main: input 'x' expects f32[8,4], got f32[8,5]", UserError);
  CHECK_THROWS_WITH_AS(interpret(p, {{"x", Array(TensorType{{8, 4}, DType::f64})}}),
                       "interpret main: input 'x' expects f32[8,4], got f64[8,4]", UserError);
  CHECK_THROWS_WITH_AS(interpret(p, {{"x", good}, {"z", good}}), "interpret main: no input named 'z'", UserError);
  CHECK(interpret(p, {{"x", good}}).at("y").shape() == Shape{8, 4});
}

TEST_CASE("interpret: outputs may name an input or the same value twice") {
  Program p("alias");
  auto x = p.add_input("x", {{3}});
  auto e = p.add(OpKind::exp, {x});
  p.add_output("x_again", x);
  p.add_output("e1", e);
  p.add_output("e2", e);
  const Array in({3}, std::vector<float>{0.f, 1.f, 2.f});
  NamedArrays out = interpret(p, {{"x", in}});
  CHECK(out.at("x_again") == in);
  CHECK(out.at("e1") == out.at("e2"));
  CHECK(out.at("e1").at(2) == doctest::Approx(std::exp(2.0)));
  out.at("e1").set(0, 42);  // separate buffers
  CHECK(out.at("e2").at(0) == 1);
}

TEST_CASE("interpret: peak memory counts inputs, live intermediates and outputs") {
  // x f32[8,4] 128 B and w f32[4,2] 32 B are resident throughout: 160 B.
  Program p("mem");
  auto x = p.add_input("x", {{8, 4}});
  auto w = p.add_input("w", {{4, 2}});
  Attrs dot;
  dot.dot = {{}, {}, {1}, {0}};
  auto h = p.add(OpKind::dot_general, {x, w}, dot);  // 64 B, an output: stays    -> 224
  auto t = p.add(OpKind::tanh, {h});                 // 64 B                      -> 288
  p.add(OpKind::exp, {t});                           // 64 B, unused: only at its op -> 352 (peak), 288
  Attrs all;
  all.dims = {0, 1};
  auto s = p.add(OpKind::reduce_sum, {t}, all);      // 4 B; t's last use          -> 292, 228
  p.add_output("h", h);
  p.add_output("s", s);
  Rng rng(15);
  RunStats stats;
  interpret(p, {{"x", random_array(rng, {{8, 4}})}, {"w", random_array(rng, {{4, 2}})}}, &stats);
  CHECK(stats.peak_bytes == 352);

  // A chain frees as it goes: the peak is the input plus one operand and one result.
  Program chain("chain");
  ValueId v = chain.add_input("x", {{1000}});
  for (int i = 0; i < 10; ++i) v = chain.add(OpKind::neg, {v});
  chain.add_output("y", v);
  interpret(chain, {{"x", Array(TensorType{{1000}})}}, &stats);
  CHECK(stats.peak_bytes == 2 * 4000);  // fused: one loop, no intermediate buffers
  set_fusion(false);
  interpret(chain, {{"x", Array(TensorType{{1000}})}}, &stats);
  set_fusion(true);
  CHECK(stats.peak_bytes == 3 * 4000);
}

TEST_CASE("interpret: recycled buffers never leak stale values into results") {
  // Each fill run frees an f32[64,64] intermediate full of 7s into the buffer cache; the next run's pad or
  // scatter_add result of that type reuses it and must still start from zeros.
  Program fill("fill");
  auto x = fill.add_input("x", {{64, 64}});
  Attrs all;
  all.dims = {0, 1};
  fill.add_output("s", fill.add(OpKind::reduce_sum, {fill.add(OpKind::add, {x, x})}, all));
  const NamedArrays halves{{"x", Array({64, 64}, std::vector<float>(64 * 64, 3.5f))}};

  interpret(fill, halves);
  CHECK(kernels::buffer_cache().bytes() >= 64 * 64 * 4);
  Attrs pad;
  pad.lo = {1, 0};
  pad.hi = {1, 0};
  const Array padded = run(OpKind::pad, {Array({62, 64}, std::vector<float>(62 * 64, 1.f))}, pad);
  CHECK(padded.at(0) == 0);
  CHECK(padded.at(64 * 64 - 1) == 0);
  CHECK(padded.at(64) == 1);

  interpret(fill, halves);
  Attrs scatter;
  scatter.shape = {64, 64};
  const Array summed = run(OpKind::scatter_add, {Array({1}, std::vector<std::int32_t>{2}), Array({1, 64}, std::vector<float>(64, 1.f))}, scatter);
  CHECK(summed.at(0) == 0);
  CHECK(summed.at(2 * 64) == 1);
}

TEST_CASE("init_inputs: deterministic per (seed, name), with the requested statistics") {
  Program p("init");
  p.add_input("x", {{4}});
  p.add_input("ids", {{4}, DType::i32});
  p.add_input("w", {{100, 100}}, InputKind::parameter, {Init::Kind::normal, 0.5});
  p.add_input("v", {{100, 100}}, InputKind::parameter, {Init::Kind::normal, 0.5});
  p.add_input("u", {{10000}, DType::f64}, InputKind::parameter, {Init::Kind::uniform, 2.0});
  p.add_input("b", {{3}}, InputKind::parameter, {Init::Kind::ones, 0});
  p.add_input("opt/m/w", {{3}}, InputKind::optimizer_state);

  const NamedArrays a = init_inputs(p, 1), b = init_inputs(p, 1), c = init_inputs(p, 2);
  CHECK(a.size() == 5);  // data inputs only on request
  CHECK(a.count("x") == 0);
  CHECK(a == b);
  CHECK(a.at("w") != a.at("v"));
  CHECK(a.at("w") != c.at("w"));

  auto moments = [](const Array& x) {
    double sum = 0, sq = 0;
    for (std::int64_t i = 0; i < x.size(); ++i) {
      sum += x.at(i);
      sq += x.at(i) * x.at(i);
    }
    const double mean = sum / static_cast<double>(x.size());
    return std::pair{mean, std::sqrt(sq / static_cast<double>(x.size()) - mean * mean)};
  };
  const auto [mean, stddev] = moments(a.at("w"));
  CHECK(std::abs(mean) < 0.025);  // 5 standard errors of the mean
  CHECK(std::abs(stddev - 0.5) < 0.02);
  const auto [umean, ustd] = moments(a.at("u"));
  CHECK(std::abs(umean) < 0.06);
  CHECK(std::abs(ustd - 2.0 / std::sqrt(3.0)) < 0.04);
  for (std::int64_t i = 0; i < a.at("u").size(); ++i) CHECK_UNARY(std::abs(a.at("u").at(i)) <= 2.0);
  CHECK(a.at("b") == Array({3}, std::vector<float>{1, 1, 1}));
  CHECK(a.at("opt/m/w") == Array({3}, std::vector<float>{0, 0, 0}));

  // Pinned values: SplitMix64 and the transforms are written out, so these hold for every standard library
  // (the normal ones up to the last bit of libm's log, sin and cos).
  const Array u = init_array({{3}, DType::f64}, {Init::Kind::uniform, 1.0}, 0, "w");
  CHECK(u == Array({3}, std::vector<double>{0.90853209389424916, 0.28919775779725754, 0.039859704720495825}));
  const Array n = init_array({{3}, DType::f64}, {Init::Kind::normal, 1.0}, 0, "w");
  const std::vector<double> pinned{-1.5273501223903616, -1.9588338896131519, 0.64860607287793259};
  for (std::int64_t i = 0; i < 3; ++i) CHECK(n.at(i) == doctest::Approx(pinned[static_cast<std::size_t>(i)]).epsilon(1e-14));

  const NamedArrays with_data = init_inputs(p, 1, true);
  CHECK(with_data.size() == 7);
  CHECK(with_data.at("ids") == Array({4}, std::vector<std::int32_t>{0, 0, 0, 0}));
  CHECK(with_data.at("x") != Array({4}, std::vector<float>{0, 0, 0, 0}));
  CHECK(with_data.at("w") == a.at("w"));
}

TEST_CASE("init_piece: a device's piece equals its shard of the whole tensor, for every layout") {
  // Tiled dims, two axes on one dim, replicated axes, scalars, odd sizes: a device draws only its piece,
  // and it must be exactly layout::shard of init_array.
  const Mesh mesh{{"a", 2}, {"b", 3}, {"c", 2}};
  struct Case {
    Shape shape;
    Sharding sharding;
  };
  const std::vector<Case> cases = {
      {{}, Sharding::replicated(0)},
      {{6, 5}, {{{"b"}, {}}, {}}},
      {{4, 9}, {{{"c"}, {"b"}}, {}}},
      {{12, 3, 2}, {{{"a", "b"}, {}, {"c"}}, {}}},
      {{2, 7, 6}, {{{}, {}, {"b", "a"}}, {}}},
      {{5, 8}, {{{}, {"c", "a"}}, {}}},
  };
  for (const auto& c : cases)
    for (const Init init : {Init{Init::Kind::normal, 0.5}, Init{Init::Kind::uniform, 2.0}, Init{Init::Kind::ones, 0}})
      for (DType t : {DType::f32, DType::f64}) {
        const TensorType type{c.shape, t};
        INFO(to_string(type, c.sharding) << " " << static_cast<int>(init.kind));
        const Array whole = init_array(type, init, 9, "params/w");
        for (std::int64_t d = 0; d < mesh.num_devices(); ++d)
          CHECK(init_piece(type, init, 9, "params/w", c.sharding, mesh, d) == layout::shard(whole, c.sharding, mesh, d));
      }
}

TEST_CASE("layout: a piece under one layout, assembled from the overlaps of the pieces under another, is its shard") {
  // What checkpoint::restore does when it restores onto another mesh or schedule.
  Rng rng(31);
  const Mesh from_mesh{{"a", 2}, {"b", 3}}, to_mesh{{"x", 4}, {"y", 2}};
  const Array whole = random_array(rng, {{12, 6, 4}, DType::f32});
  const std::vector<Sharding> from = {Sharding::replicated(3), {{{"a"}, {"b"}, {}}, {}}, {{{"b", "a"}, {}, {}}, {}},
                                      {{{}, {"b"}, {"a"}}, {}}};
  const std::vector<Sharding> to = {Sharding::replicated(3), {{{"x"}, {}, {"y"}}, {}}, {{{"y", "x"}, {}, {}}, {}},
                                    {{{}, {"y"}, {"x"}}, {}}};
  for (const Sharding& f : from)
    for (const Sharding& t : to)
      for (std::int64_t d = 0; d < to_mesh.num_devices(); ++d) {
        INFO(to_string(whole.type(), f) << " -> " << to_string(whole.type(), t) << " device " << d);
        const Array want = layout::shard(whole, t, to_mesh, d);
        Array got(want.type());
        for (std::int64_t s = 0; s < from_mesh.num_devices(); ++s)
          layout::copy_overlap(layout::shard(whole, f, from_mesh, s), layout::piece_offset(whole.shape(), f, from_mesh, s),
                               got, layout::piece_offset(whole.shape(), t, to_mesh, d));
        CHECK(got == want);
      }
}

TEST_CASE("runtime: every GEMM engine built in agrees with Eigen and the definition (random layouts, batched, transposed, f32 and f64)") {
  CHECK(gemm_engine() == best_gemm_engine());
  MESSAGE("GEMM engines built in: " << gemm_engines_built_in());
  Rng rng(21);
  auto each = [&](const Array& lhs, const Array& rhs, const DotDims& d, const std::string& what) {
    set_gemm_engine(GemmEngine::eigen);
    const Array eigen = run_dot(lhs, rhs, d);
    for (GemmEngine e : all_gemm_engines)
      if (built_in(e) && e != GemmEngine::eigen) {
        set_gemm_engine(e);
        check_close(run_dot(lhs, rhs, d), eigen, std::string(name_of(e)) + " vs eigen: " + what);
      }
    return eigen;
  };
  for (int trial = 0; trial < 120; ++trial) {
    const DotCase c = random_dot(rng, trial % 2 ? 24 : 40);  // mostly above the GEMM size threshold
    for (DType dt : float_dtypes) {
      const Array lhs = random_array(rng, {c.lhs, dt}), rhs = random_array(rng, {c.rhs, dt});
      each(lhs, rhs, c.dims, describe({lhs, rhs}));
    }
  }
  // Every in-place layout the engines see: row- and column-major operands, leading dims with an outer stride
  // (batch and free dims interleaved), batch dims with their own strides (one oneDNN primitive, a loop of
  // cblas calls), more batch dims than oneDNN takes (12 dims: the fallback).
  const std::int64_t m = 67, k = 45, n = 53;
  const std::vector<DotCase> layouts{
      {{m, k}, {k, n}, {{}, {}, {1}, {0}}},
      {{k, m}, {k, n}, {{}, {}, {0}, {0}}},
      {{m, k}, {n, k}, {{}, {}, {1}, {1}}},
      {{k, m}, {n, k}, {{}, {}, {0}, {1}}},
      {{5, m, k}, {5, k, n}, {{0}, {0}, {2}, {1}}},
      {{2, 24, 3, 21}, {2, 26, 3, 21}, {{0, 2}, {0, 2}, {3}, {3}}},
      {{2, 3, 24, 26}, {2, 26, 3, 21}, {{0, 1}, {0, 2}, {3}, {1}}},
      {{m, 5, 7}, {7, 5, n}, {{}, {}, {1, 2}, {1, 0}}},
      {{4, m, 3, k}, {3, k, 4, n}, {{0, 2}, {2, 0}, {3}, {1}}},
      {{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 30, 20}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 20, 25},
       {{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {12}, {11}}},
  };
  onednn::clear_cache();
  for (const auto& c : layouts)
    for (DType dt : float_dtypes) {
      const Array lhs = random_array(rng, {c.lhs, dt}), rhs = random_array(rng, {c.rhs, dt});
      const Array eigen = each(lhs, rhs, c.dims, describe({lhs, rhs}));
      check_close(eigen, dot_ref(lhs, rhs, c.dims), describe({lhs, rhs}) + "vs definition");
    }
  if (built_in(GemmEngine::onednn)) {
    // oneDNN took every f32 and bf16 layout in place (the 13-dim one never reaches it); running them again creates none.
    const onednn::CacheStats after = onednn::cache_stats();
    CHECK(after == onednn::CacheStats{2 * (layouts.size() - 1), 0});  // f32 and bf16 (f16 computes in f32)
    set_gemm_engine(GemmEngine::onednn);
    for (const auto& c : layouts) run_dot(random_array(rng, {c.lhs, DType::f32}), random_array(rng, {c.rhs, DType::f32}), c.dims);
    CHECK(onednn::cache_stats() == after);
  }
  set_gemm_engine(best_gemm_engine());
}

TEST_CASE("runtime: convolutions agree on every GEMM engine; oneDNN runs convolutions and flipped (input-gradient) ones as primitives") {
  Rng rng(23);
  auto draw = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };
  std::size_t expect_primitive = 0, expect_fallback = 0;
  onednn::clear_cache();
  for (int trial = 0; trial < 60; ++trial) {
    // x [N, spatial..., C] * w [window..., C / G, O], padding from -1 to 3, strides and dilations up to 3 and 2;
    // flipped windows with input dilation (a strided convolution's input gradient) or a stride (neither primitive).
    const auto spatial = static_cast<std::size_t>(draw(1, 3));
    const std::int64_t groups = draw(1, 3), C = groups * draw(1, 4), O = groups * draw(1, 4);
    ConvDims c{{}, {}, {}, draw(0, 1) == 1, groups};
    Shape x{draw(1, 3)}, w;
    std::vector<std::int64_t> lo, hi;
    for (std::size_t d = 0; d < spatial; ++d) {
      const std::int64_t size = draw(1, spatial == 3 ? 5 : 9), taps = draw(1, 4);
      c.strides.push_back(c.flip && draw(0, 3) > 0 ? 1 : draw(1, 3));
      c.lhs_dilation.push_back(draw(0, 2) == 0 ? draw(2, 3) : 1);
      c.rhs_dilation.push_back(draw(1, 2));
      lo.push_back(draw(-1, 3));
      hi.push_back(std::max((taps - 1) * c.rhs_dilation.back() + 1 - (size - 1) * c.lhs_dilation.back() - 1 - lo.back(), draw(-1, 3)));
      x.push_back(size);
      w.push_back(taps);
    }
    x.push_back(C);
    w.insert(w.end(), {C / groups, O});
    const auto ones = [](const std::vector<std::int64_t>& v) { return std::all_of(v.begin(), v.end(), [](auto e) { return e == 1; }); };
    // oneDNN's padding: a flipped window's is (K - 1) d less partir's; negative padding it may decline.
    bool padded = true;
    for (std::size_t d = 0; d < spatial; ++d) {
      const std::int64_t span = c.flip ? (w[d] - 1) * c.rhs_dilation[d] : 0;
      padded = padded && (c.flip ? span - lo[d] : lo[d]) >= 0 && (c.flip ? span - hi[d] : hi[d]) >= 0;
    }
    const bool qualifies = ones(c.flip ? c.strides : c.lhs_dilation);
    for (DType dt : float_dtypes) {
      const Program f = trace("conv", [&](Tensor a, Tensor b) { return conv_general(a, b, c, lo, hi); }, {{"x", x, dt}, {"w", w, dt}});
      const NamedArrays in{{"x", random_array(rng, {x, dt})}, {"w", random_array(rng, {w, dt})}};
      set_gemm_engine(GemmEngine::eigen);
      const Array eigen = interpret(f, in).begin()->second;
      const onednn::CacheStats before = onednn::cache_stats();
      for (GemmEngine e : all_gemm_engines)
        if (built_in(e) && e != GemmEngine::eigen) {
          set_gemm_engine(e);
          check_close(interpret(f, in).begin()->second, eigen,
                      std::string(name_of(e)) + " vs eigen: " + to_string(f.type(f.outputs().at(0).value)) + " from " +
                          describe({in.at("x"), in.at("w")}) + (c.flip ? " flipped" : ""));
        }
      if (built_in(GemmEngine::onednn) && (dt == DType::f32 || dt == DType::bf16)) {
        const onednn::CacheStats after = onednn::cache_stats();
        const std::size_t made = after.convolutions - before.convolutions;
        if (!qualifies) CHECK(made == 0);
        if (qualifies && padded) CHECK(made == 1);
        expect_primitive += made;
        expect_fallback += !qualifies;
      }
    }
  }
  if (built_in(GemmEngine::onednn)) {
    const onednn::CacheStats stats = onednn::cache_stats();
    MESSAGE("oneDNN convolution primitives: " << stats.convolutions << " (" << stats.rejected_convolutions << " declined, "
                                              << expect_fallback << " by im2col)");
    CHECK(stats.convolutions == expect_primitive);  // no other convolution made one
    CHECK((expect_primitive > 0 && expect_fallback > 0));
  }
  set_gemm_engine(best_gemm_engine());
}

TEST_CASE("runtime: GEMM engines by name") {
  for (GemmEngine e : all_gemm_engines)
    if (built_in(e)) CHECK(parse_gemm_engine(name_of(e)) == e);
  CHECK(gemm_engines_built_in().find(name_of(best_gemm_engine())) == 0);  // listed best first
}

TEST_CASE("runtime: oneDNN runs each device's GEMMs on that device's share of the thread budget") {
  if (!built_in(GemmEngine::onednn)) {
    MESSAGE("this build has no oneDNN: skipped");
    return;
  }
  set_gemm_engine(GemmEngine::onednn);
  Rng rng(5);
  const Array lhs = random_array(rng, {{64, 48}, DType::f32}), rhs = random_array(rng, {{48, 40}, DType::f32});
  const DotDims d{{}, {}, {1}, {0}};
  check_close(run_dot(lhs, rhs, d), dot_ref(lhs, rhs, d), "one device");
  CHECK(onednn::team_size() == kernel_threads());
  // Two devices on the threads backend: each device thread runs its own OpenMP team of budget / 2 threads
  // (one each on two cores), not two teams of the whole budget.
  std::vector<int> teams(2, -1);
  threads::run(2, [&](threads::Communicator& comm) {
    check_close(run_dot(lhs, rhs, d), dot_ref(lhs, rhs, d), "device thread");
    teams[static_cast<std::size_t>(comm.device())] = onednn::team_size();
  });
  for (int t : teams) CHECK(t == std::max(1, thread_budget() / 2));
  CHECK(onednn::team_size() == kernel_threads());  // this thread's team is untouched by the devices'
}

namespace {

// A random elementwise program over x, y (shape s) and a vector b (the last dim of s), with scalar, row
// and column broadcasts, compare and select, and values used once, twice or as outputs.
Program random_elementwise(Rng& rng, const Shape& s, DType dt) {
  Program p("ew");
  std::vector<ValueId> pool{p.add_input("x", {s, dt}), p.add_input("y", {s, dt})};
  const ValueId b = p.add_input("b", {{s.back()}, dt});
  const ValueId c = p.add_input("c", {{s.front()}, dt});
  auto pick = [&] { return pool[static_cast<std::size_t>(rand_int(rng, 0, static_cast<std::int64_t>(pool.size()) - 1))]; };
  for (int i = 0; i < 14; ++i) {
    Attrs a;
    ValueId v = -1;
    switch (rand_int(rng, 0, dt == DType::f32 ? 7 : 6)) {
      case 0: {  // unary on values kept positive where it matters
        const OpKind kinds[] = {OpKind::neg, OpKind::exp, OpKind::tanh, OpKind::abs};
        v = p.add(kinds[rand_int(rng, 0, 3)], {pick()});
        if (p.op(v).kind == OpKind::exp) v = p.add(OpKind::tanh, {v});
        break;
      }
      case 1: case 2: {
        const OpKind kinds[] = {OpKind::add, OpKind::sub, OpKind::mul, OpKind::max, OpKind::min};
        v = p.add(kinds[rand_int(rng, 0, 4)], {pick(), pick()});
        break;
      }
      case 3: {  // a broadcast: scalar constant, row b or column c
        const auto which = rand_int(rng, 0, 2);
        if (which == 0) {
          a.literal = {0.5 + static_cast<double>(rand_int(rng, 0, 4))};
          a.dtype = dt;
          const ValueId k = p.add(OpKind::constant, {}, a);
          Attrs bc;
          bc.shape = s;
          v = p.add(OpKind::broadcast_in_dim, {k}, bc);
        } else {
          Attrs bc;
          bc.shape = s;
          bc.dims = {which == 1 ? static_cast<std::int64_t>(s.size()) - 1 : 0};
          v = p.add(OpKind::broadcast_in_dim, {which == 1 ? b : c}, bc);
        }
        v = p.add(OpKind::mul, {v, pick()});
        break;
      }
      case 4: {
        a.cmp = rand_int(rng, 0, 1) ? CompareDir::gt : CompareDir::eq;
        v = p.add(OpKind::compare, {pick(), pick()}, a);
        break;
      }
      case 5: {
        Attrs cmp;
        cmp.cmp = CompareDir::lt;
        v = p.add(OpKind::select, {p.add(OpKind::compare, {pick(), pick()}, cmp), pick(), pick()});
        break;
      }
      case 6: v = p.add(OpKind::rsqrt, {p.add(OpKind::add, {p.add(OpKind::mul, {pick(), pick()}), pick()})}); break;
      default: {  // through 16 bits and back, as a mixed-precision gradient enters the f32 update
        a.dtype = rand_int(rng, 0, 1) ? DType::bf16 : DType::f16;
        const ValueId half = p.add(OpKind::convert, {pick()}, a);
        a.dtype = DType::f32;
        v = p.add(OpKind::sub, {pick(), p.add(OpKind::convert, {half}, a)});
        break;
      }
    }
    pool.push_back(v);
    if (rand_int(rng, 0, 5) == 0) p.add_output("o" + std::to_string(i), v);
  }
  p.add_output("last", pool.back());
  return p;
}

// The f32 twin of 16-bit program p under plan: the same ops in f32, rounded through p's dtype (a convert
// there and back) wherever the plan stores a value: what the fused 16-bit groups compute, step by step.
Program rounded_where_stored(const Program& p, const FusionPlan& plan) {
  Program q("ew_f32");
  std::vector<ValueId> to(static_cast<std::size_t>(p.size()));
  for (ValueId v = 0; v < p.size(); ++v) {
    const Op& o = p.op(v);
    Attrs a = o.attrs;
    a.dtype = DType::f32;
    std::vector<ValueId> operands;
    for (auto x : o.operands) operands.push_back(to[static_cast<std::size_t>(x)]);
    ValueId w = o.kind == OpKind::input ? q.add_input(o.name, {o.type.shape, DType::f32}) : q.add(o.kind, operands, a);
    if (!plan.skipped(v) && o.kind != OpKind::input) {
      Attrs narrow, widen;
      narrow.dtype = o.type.dtype;
      w = q.add(OpKind::convert, {q.add(OpKind::convert, {w}, narrow)}, widen);
    }
    to[static_cast<std::size_t>(v)] = w;
  }
  for (const auto& out : p.outputs()) q.add_output(out.name, to[static_cast<std::size_t>(out.value)]);
  return q;
}

}  // namespace

// f32 and f64 groups give bitwise what the ops give one by one. 16-bit groups keep f32 between their steps
// and round what they store (fused_kernel.hpp): bitwise what the ops give in f32, rounded at the same places.
TEST_CASE("fusion: fused groups give bitwise the unfused results, at every size") {
  Rng rng(22);
  int fused_groups = 0, skipped_broadcasts = 0, skipped_converts = 0, side_outputs = 0, narrowing_groups = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const std::int64_t rows = rand_int(rng, 1, 9);
    const std::int64_t cols = trial % 3 == 0 ? rand_int(rng, 1, 7) : rand_int(rng, 1, 300);  // under a block .. tiles
    const Shape s{rows, cols};
    for (DType dt : float_dtypes) {
      const Program p = random_elementwise(rng, s, dt);
      const FusionPlan plan = plan_fusion(p);
      fused_groups += static_cast<int>(plan.groups().size());
      for (const auto& g : plan.groups()) {
        side_outputs += static_cast<int>(g.side_outputs.size());
        narrowing_groups += g.steps.back().kind == OpKind::convert;
      }
      for (ValueId v = 0; v < p.size(); ++v) {
        skipped_broadcasts += plan.skipped(v) && p.op(v).kind == OpKind::broadcast_in_dim;
        skipped_converts += plan.skipped(v) && p.op(v).kind == OpKind::convert;
      }
      NamedArrays in{{"x", random_array(rng, {s, dt}, 0.1, 2)}, {"y", random_array(rng, {s, dt}, -2, 2)},
                     {"b", random_array(rng, {{cols}, dt})}, {"c", random_array(rng, {{rows}, dt})}};
      const NamedArrays fused = interpret(p, in);
      set_fusion(false);
      NamedArrays plain;
      if (is_half(dt)) {
        NamedArrays wide;
        Attrs widen, narrow;
        narrow.dtype = dt;
        for (const auto& [name, value] : in) wide[name] = run(OpKind::convert, {value}, widen);
        for (const auto& [name, value] : interpret(rounded_where_stored(p, plan), wide))
          plain[name] = run(OpKind::convert, {value}, narrow);
      } else {
        plain = interpret(p, in);
      }
      set_fusion(true);
      INFO(to_string(p));
      INFO(to_string(plan));
      for (const auto& [name, value] : plain) {
        INFO(name);
        // NaN-safe bitwise comparison
        CHECK(std::memcmp(layout::bytes(fused.at(name)), layout::bytes(value),
                          static_cast<std::size_t>(value.bytes())) == 0);
      }
    }
  }
  CHECK(fused_groups > 100);
  CHECK(side_outputs > 10);  // outputs read again by later groups: stored by them (multi-output fusion)
  MESSAGE("side outputs: ", side_outputs);
  CHECK(skipped_broadcasts > 20);
  CHECK(skipped_converts > 5);  // widening ones only: a narrowing convert rounds, its result is materialized
  CHECK(narrowing_groups > 10);  // f32 steps stored narrowed by the convert that ends their group
  MESSAGE("groups ending in a narrowing convert: ", narrowing_groups);
}

TEST_CASE("fusion: large groups, converts and reductions split over the kernel threads give what one thread gives") {
  Rng rng(24);
  // Reductions split a kept leading dim; others run whole.
  for (DType dt : {DType::f32, DType::bf16})
    for (const auto& [shape, dims] : std::vector<std::pair<Shape, std::vector<std::int64_t>>>{
             {{3, 100003}, {0}}, {{100003, 3}, {1}}, {{700, 400}, {1}}, {{40, 50, 300}, {0, 2}}, {{40, 50, 300}, {1}}})
      for (OpKind kind : {OpKind::reduce_sum, OpKind::reduce_max}) {
        const Array x = random_array(rng, {shape, dt}, -1e3, 1e3);
        Attrs a;
        a.dims = dims;
        Array one, three;
        {
          const KernelThreads single(1);
          one = run(kind, {x}, a);
        }
        {
          const KernelThreads split(3);
          three = run(kind, {x}, a);
        }
        INFO(name_of(kind), " ", to_string(x.type()));
        CHECK(std::memcmp(layout::bytes(three), layout::bytes(one), static_cast<std::size_t>(one.bytes())) == 0);
      }
  const Shape s{3, 100003};  // past the split threshold, not a whole number of tiles
  const Array wide = random_array(rng, {s, DType::f32}, -1e3, 1e3);
  for (DType to : {DType::bf16, DType::f16}) {
    Attrs narrow;
    narrow.dtype = to;
    Array one, three;
    {
      const KernelThreads single(1);
      one = run(OpKind::convert, {wide}, narrow);
    }
    {
      const KernelThreads split(3);
      three = run(OpKind::convert, {wide}, narrow);
    }
    CHECK(std::memcmp(layout::bytes(three), layout::bytes(one), static_cast<std::size_t>(one.bytes())) == 0);
  }
  for (DType dt : {DType::f32, DType::bf16}) {
    const Program p = random_elementwise(rng, s, dt);
    const NamedArrays in{{"x", random_array(rng, {s, dt}, 0.1, 2)}, {"y", random_array(rng, {s, dt}, -2, 2)},
                         {"b", random_array(rng, {{s[1]}, dt})}, {"c", random_array(rng, {{s[0]}, dt})}};
    NamedArrays one, three;
    {
      const KernelThreads single(1);
      one = interpret(p, in);
    }
    {
      const KernelThreads split(3);
      three = interpret(p, in);
    }
    INFO(to_string(p));
    for (const auto& [name, value] : one)
      CHECK(std::memcmp(layout::bytes(three.at(name)), layout::bytes(value),
                        static_cast<std::size_t>(value.bytes())) == 0);
  }
}

TEST_CASE("fusion: the plan of an MLP train step") {
  nn::Mlp model{"params/mlp", {8, 16, 8}};
  const Program step = train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, SGD{0.01},
                                  {{"x", {4, 8}}, {"y", {4, 8}}});
  const FusionPlan plan = plan_fusion(step);
  INFO(to_string(step));
  // Bias adds read the bias as a row (/1%n), learning rates and constants as scalars (/1%1). The first bias
  // add (%6) is computed in the ReLU's group and again in the ReLU gradient's (its zeros broadcast again for
  // the backward pass, %28: remat.hpp's cheap values), so only the product %3 is stored; the output layer's
  // bias add and difference (%14, %15) are computed in the loss's group and again in its gradient's. Every SGD
  // update is one loop over (param, grad).
  CHECK(to_string(plan) ==
        "%9 <- add(%3,%4/1%16) max(%6,%7/1%1)\n"
        "%16 <- add(%11,%12/1%8) sub(%14,%1) mul(%15,%15)\n"
        "%24 <- add(%11,%12/1%8) sub(%14,%1) mul(%21/1%1,%15) add(%23,%23)\n"
        "%36 <- add(%3,%4/1%16) compare(%6,%28/1%1) mul(%31/1%1,%30) compare(%6,%28/1%1) add(%34,%33) mul(%26,%35)\n"
        "%42 <- mul(%39/1%1,%38) sub(%2,%41)\n"
        "%46 <- mul(%43/1%1,%37) sub(%4,%45)\n"
        "%50 <- mul(%47/1%1,%27) sub(%10,%49)\n"
        "%54 <- mul(%51/1%1,%25) sub(%12,%53)\n");
  for (ValueId v = 0; v < step.size(); ++v)
    if (step.op(v).kind == OpKind::broadcast_in_dim) CHECK(plan.skipped(v));
  CHECK(plan.copies(6) == 2);
  CHECK(plan.copies(9) == 1);
  CHECK(plan.copies(3) == 0);
}

TEST_CASE("fusion: a convert from f32 to 16 bits ends the group of the f32 steps before it") {
  // A bf16 softmax runs in f32 (the f32 list) and hands back bf16: the division and the narrowing are one
  // pass, which reads the exponentials and the sums in f32 and stores only the bf16 result.
  Rng rng(31);
  for (DType dt : {DType::bf16, DType::f16})
    for (const Shape& s : {Shape{3, 5}, Shape{4, 40}, Shape{2, 700}}) {
      const Program p = trace("softmax", [](Tensor x) { return softmax(x); }, {{"x", s, dt}});
      const FusionPlan plan = plan_fusion(p);
      INFO(to_string(p));
      INFO(to_string(plan));
      const FusionGroup* narrowing = plan.group_at(p.outputs().at(0).value);
      REQUIRE(narrowing != nullptr);
      CHECK(narrowing->type == TensorType{s, dt});
      CHECK(narrowing->steps.size() == 2);
      CHECK(narrowing->steps.front().kind == OpKind::div);
      CHECK(narrowing->steps.back().kind == OpKind::convert);
      CHECK(plan.skipped(narrowing->steps.front().value));  // the f32 quotient is never stored
      const NamedArrays in{{"x", random_array(rng, {s, dt}, -3, 3)}};
      const NamedArrays fused = interpret(p, in);
      set_fusion(false);
      const NamedArrays plain = interpret(p, in);
      set_fusion(true);
      CHECK(std::memcmp(layout::bytes(fused.at("out")), layout::bytes(plain.at("out")),
                        static_cast<std::size_t>(plain.at("out").bytes())) == 0);
    }
  // A lone narrowing convert (a parameter's 16-bit copy) is convert's own kernel, not a group.
  const Program cast = trace("cast", [](Tensor x) { return convert(x, DType::bf16); }, {{"x", {4, 64}}});
  CHECK(plan_fusion(cast).groups().empty());
}

TEST_CASE("fusion: a group reading what an earlier group stores computes it and stores it itself") {
  // Adam: the parameter update reads the new m and v (outputs), so its group computes them and stores them too.
  nn::Mlp model{"params/mlp", {8, 16, 8}};
  const Program step = train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{0.01},
                                  {{"x", {4, 8}}, {"y", {4, 8}}});
  const FusionPlan plan = plan_fusion(step);
  INFO(to_string(plan));
  int updates = 0;
  for (const auto& g : plan.groups()) {
    if (g.side_outputs.empty()) continue;
    ++updates;
    CHECK(g.side_outputs.size() == 2);
    for (int k : g.side_outputs) {
      const ValueId side = g.steps[static_cast<std::size_t>(k)].value;
      CHECK(plan.made_at(side) == g.root);
      CHECK(!plan.runs_at(side));
      CHECK(!plan.skipped(side));  // it has a buffer, written at the root
      CHECK(std::ranges::find(plan.last_uses()[static_cast<std::size_t>(g.root)], side) ==
            plan.last_uses()[static_cast<std::size_t>(g.root)].end());  // an output: lives to the end
    }
  }
  CHECK(updates == 4);  // two weights, two biases
  const NamedArrays in = init_inputs(step, 5, true);
  const NamedArrays fused = interpret(step, in);
  set_fusion(false);
  const NamedArrays plain = interpret(step, in);
  set_fusion(true);
  for (const auto& [name, value] : plain) CHECK_MESSAGE(fused.at(name) == value, name);  // bitwise

  // Producer a = exp(x' * y') (an output, from two reshapes), consumer c = tanh(a + z).
  auto program = [](bool y_read_later, bool a_read_between) {
    Program p("merge");
    const Shape s{64};
    Attrs flat;
    flat.shape = s;
    const ValueId x = p.add(OpKind::reshape, {p.add_input("x", {{8, 8}})}, flat);
    const ValueId y = p.add(OpKind::reshape, {p.add_input("y", {{8, 8}})}, flat);
    const ValueId a = p.add(OpKind::exp, {p.add(OpKind::mul, {x, y})});
    if (a_read_between) p.add_output("sum", p.add(OpKind::reduce_sum, {a}, [] { Attrs r; r.dims = {0}; return r; }()));
    const ValueId c = p.add(OpKind::tanh, {p.add(OpKind::add, {a, p.add_input("z", {s})})});
    p.add_output("a", a);
    p.add_output("c", c);
    if (y_read_later) p.add_output("y_flat", p.add(OpKind::neg, {y}));
    return p;
  };
  auto stores = [](const Program& p) {
    const FusionPlan fp = plan_fusion(p);
    int n = 0;
    for (const auto& g : fp.groups()) n += static_cast<int>(g.side_outputs.size());
    return n;
  };
  // Merged, a's two inputs would live on to c's group while a itself is no longer held in between: merged only
  // when what lives longer (x' and y' if both die at a) weighs no more than a.
  CHECK(stores(program(true, false)) == 1);
  CHECK(stores(program(false, false)) == 0);
  CHECK(stores(program(true, true)) == 0);  // the reduce_sum reads a before c's group runs
  const Program p = program(true, false);
  Rng rng(31);
  const NamedArrays xyz{{"x", random_array(rng, {{8, 8}})}, {"y", random_array(rng, {{8, 8}})},
                        {"z", random_array(rng, {{64}})}};
  const NamedArrays merged = interpret(p, xyz);
  set_fusion(false);
  const NamedArrays alone = interpret(p, xyz);
  set_fusion(true);
  for (const auto& [name, value] : alone) CHECK_MESSAGE(merged.at(name) == value, name);
}

TEST_CASE("interpret: a reshape of a dying intermediate takes its buffer, values intact") {
  Program p("reshape");
  const ValueId x = p.add_input("x", {{6, 50}});
  Attrs to;
  to.shape = {300};
  const ValueId r = p.add(OpKind::reshape, {p.add(OpKind::exp, {x})}, to);
  p.add_output("y", p.add(OpKind::neg, {r}));
  p.add_output("r", r);
  Rng rng(23);
  const Array in = random_array(rng, {{6, 50}});
  const NamedArrays out = interpret(p, {{"x", in}});
  for (std::int64_t i = 0; i < 300; ++i) {
    CHECK(out.at("r").at(i) == doctest::Approx(std::exp(in.at(i))).epsilon(1e-6));
    CHECK(out.at("y").at(i) == -out.at("r").at(i));
  }
}
