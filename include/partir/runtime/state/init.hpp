#pragma once
// Initial values of parameters and optimizer state. The numbers depend only on (seed, input name, type and
// Init), never on the standard library, backend or shard layout. Element i of a tensor is drawn from a
// counter (SplitMix64 at position i of the stream of (seed, name)), not from a sequential generator, so a
// device draws just its piece of a parameter (init_piece) and gets the numbers the whole tensor has there:
// a ZeRO-3 plan never holds a whole parameter, not even at initialization. The uniform and normal
// transforms are written here rather than taken from <random>'s distributions, whose results differ
// between libraries.
#include <cmath>
#include <numbers>
#include <string_view>

#include "partir/ir/program.hpp"
#include "partir/runtime/kernels/array.hpp"
#include "partir/runtime/kernels/layout.hpp"

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

inline std::uint64_t init_stream(std::uint64_t seed, std::string_view name) {
  return splitmix64(splitmix64(seed) ^ fnv1a(name));
}

// Uniform in [0, 1) from the top 53 bits of draw i of the stream (exactly representable as a double).
inline double unit_uniform(std::uint64_t stream, std::uint64_t i) {
  return static_cast<double>(splitmix64(stream + i * 0x9e3779b97f4a7c15ULL) >> 11) * 0x1.0p-53;
}

// Element i: normal values come from Box-Muller, elements 2k and 2k+1 sharing draws 2k and 2k+1.
inline double init_value(const Init& init, std::uint64_t stream, std::uint64_t i) {
  switch (init.kind) {
    case Init::Kind::zeros: return 0;
    case Init::Kind::ones: return 1;
    case Init::Kind::constant: return init.scale;
    case Init::Kind::uniform: return init.scale * (2 * unit_uniform(stream, i) - 1);
    case Init::Kind::normal: {
      const std::uint64_t pair = i & ~std::uint64_t{1};
      const double radius = std::sqrt(-2 * std::log(1 - unit_uniform(stream, pair)));  // log of (0, 1]
      const double angle = 2 * std::numbers::pi * unit_uniform(stream, pair + 1);
      return init.scale * radius * (i & 1 ? std::sin(angle) : std::cos(angle));
    }
  }
  internal_error("unknown init kind");
}

}  // namespace detail

// This device's piece of a tensor of global type `type` laid out by `sharding`: equal to
// layout::shard(init_array(type, ...), sharding, mesh, device), without making the whole tensor.
inline Array init_piece(const TensorType& type, const Init& init, std::uint64_t seed, std::string_view name,
                        const Sharding& sharding, const Mesh& mesh, std::int64_t device) {
  Array out(TensorType{local_shape(type, sharding, mesh), type.dtype});
  if (init.kind == Init::Kind::zeros) return out;
  if (!sharding.partial.empty() && mesh.position(device, sharding.partial) != 0) return out;  // as layout::shard
  const std::uint64_t stream = detail::init_stream(seed, name);
  std::visit([&](auto& values) {
    using T = std::decay_t<decltype(values[0])>;
    layout::for_each_run(out.shape(), type.shape, layout::piece_offset(type.shape, sharding, mesh, device),
                         [&](std::int64_t local, std::int64_t at, std::int64_t n) {
                           for (std::int64_t k = 0; k < n; ++k)
                             values[static_cast<std::size_t>(local + k)] =
                                 static_cast<T>(detail::init_value(init, stream, static_cast<std::uint64_t>(at + k)));
                         });
  }, out.storage());
  return out;
}

// Row-major values of one whole tensor.
inline Array init_array(const TensorType& type, const Init& init, std::uint64_t seed, std::string_view name) {
  return init_piece(type, init, seed, name, Sharding::replicated(type.rank()), Mesh{}, 0);
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
