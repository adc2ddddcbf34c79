#pragma once
// Initial values of parameters and optimizer state. The numbers depend only on (seed, input name, type and
// Init), never on the standard library, backend or shard layout: each input draws from its own
// std::mt19937_64 (whose output the C++ standard fixes), and the uniform and normal transforms are written
// here rather than taken from <random>'s distributions, whose results differ between libraries.
#include <cmath>
#include <numbers>
#include <random>
#include <string_view>

#include "partir/ir/program.hpp"
#include "partir/runtime/array.hpp"

namespace partir {

namespace detail {

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// Uniform in [0, 1) from the top 53 bits, exactly representable as a double.
inline double unit_uniform(std::mt19937_64& gen) { return static_cast<double>(gen() >> 11) * 0x1.0p-53; }

}  // namespace detail

// Row-major values of one tensor, drawn from the stream of (seed, name). Normal values come from
// Box-Muller, both of each pair used in order.
inline Array init_array(const TensorType& type, const Init& init, std::uint64_t seed, std::string_view name) {
  Array out(type);
  std::mt19937_64 gen(detail::splitmix64(detail::splitmix64(seed) ^ detail::fnv1a(name)));
  double spare = 0;
  bool has_spare = false;
  auto draw = [&]() -> double {
    switch (init.kind) {
      case Init::Kind::zeros: return 0;
      case Init::Kind::ones: return 1;
      case Init::Kind::uniform: return init.scale * (2 * detail::unit_uniform(gen) - 1);
      case Init::Kind::normal: {
        if (has_spare) {
          has_spare = false;
          return init.scale * spare;
        }
        const double radius = std::sqrt(-2 * std::log(1 - detail::unit_uniform(gen)));  // log of (0, 1]
        const double angle = 2 * std::numbers::pi * detail::unit_uniform(gen);
        spare = radius * std::sin(angle);
        has_spare = true;
        return init.scale * radius * std::cos(angle);
      }
    }
    internal_error("unknown init kind");
  };
  if (init.kind != Init::Kind::zeros)
    std::visit([&](auto& values) {
      for (auto& x : values) x = static_cast<std::decay_t<decltype(x)>>(draw());
    }, out.storage());
  return out;
}

// An Array for every parameter and optimizer-state input, following its Init. With include_data, data
// inputs too: by their Init if the program gives one, else normal(1) for floats and zeros for i32 (a valid
// index into any table).
inline NamedArrays init_inputs(const Program& p, std::uint64_t seed, bool include_data = false) {
  NamedArrays out;
  for (auto v : p.inputs()) {
    const Op& op = p.op(v);
    Init init = op.attrs.init;
    if (op.attrs.input_kind == InputKind::data) {
      if (!include_data) continue;
      if (init == Init{} && is_float(op.type.dtype)) init = {Init::Kind::normal, 1.0};
    }
    out.emplace(op.name, init_array(op.type, init, seed, op.name));
  }
  return out;
}

}  // namespace partir
