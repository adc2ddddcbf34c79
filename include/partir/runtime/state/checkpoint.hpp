#pragma once
// Sharded checkpoints of training state (parameters and optimizer state, with the step count).
//
//   DIR/LATEST                 "step-<N>": the last complete checkpoint (replaced atomically)
//   DIR/step-<N>/shard-<d>.bin device d's pieces, each named, typed and shaped
//   DIR/step-<N>/manifest.txt  step, mesh, each tensor's global type and sharding, each shard's size and checksum
//
// Every file is written to a temporary name, fsynced and renamed, and LATEST is replaced only after every
// shard and the manifest are on disk: a crash mid-save leaves the previous checkpoint as LATEST. restore()
// checks each shard against the manifest (missing, truncated or corrupted shards are UserErrors naming the
// file) and assembles each device's piece, under the program's own layout, from the parts of the saved
// pieces that overlap it, so a checkpoint restores onto a different mesh or schedule without any device
// holding a whole tensor. Every device reads every shard, one at a time: the directory must be visible to
// all of them (one host, or a shared file system).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "partir/runtime/comm/communicator.hpp"
#include "partir/runtime/kernels/layout.hpp"
#include "partir/runtime/state/state.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir::checkpoint {

namespace detail {

inline std::uint64_t fnv1a(const std::string& bytes) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

inline void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) user_error("checkpoint: cannot open '" + path + "' to sync it");
  ::fsync(fd);
  ::close(fd);
}

// Writes `bytes` to `path` atomically: a temporary file, fsync, rename, fsync of the directory.
inline void write_atomically(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out.flush()) user_error("checkpoint: cannot write '" + tmp + "'");
  }
  fsync_path(tmp, false);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) user_error("checkpoint: cannot rename '" + tmp + "' to '" + path + "'");
  fsync_path(std::filesystem::path(path).parent_path().string(), true);
}

inline std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline std::string shape_text(const Shape& s) {
  if (s.empty()) return "-";
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out;
}
inline Shape parse_shape(const std::string& t) {
  Shape s;
  if (t == "-") return s;
  std::stringstream in(t);
  for (std::string item; std::getline(in, item, ',');) s.push_back(std::stoll(item));
  return s;
}
// dims separated by ';', axes of a dim by ','; '-' for a replicated dim (and for rank 0).
inline std::string dims_text(const Sharding& s) {
  if (s.dims.empty()) return "-";
  std::string out;
  for (std::size_t d = 0; d < s.dims.size(); ++d) {
    out += d ? ";" : "";
    if (s.dims[d].empty()) out += "-";
    for (std::size_t a = 0; a < s.dims[d].size(); ++a) out += (a ? "," : "") + s.dims[d][a];
  }
  return out;
}
inline Sharding parse_dims(const std::string& t, std::int64_t rank) {
  Sharding s = Sharding::replicated(rank);
  if (rank == 0) return s;
  std::stringstream in(t);
  std::size_t d = 0;
  for (std::string dim; std::getline(in, dim, ';'); ++d) {
    if (d >= s.dims.size()) user_error("too many dims in '" + t + "'");
    if (dim == "-") continue;
    std::stringstream axes(dim);
    for (std::string a; std::getline(axes, a, ',');) s.dims[d].push_back(a);
  }
  return s;
}

inline std::string hex(std::uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

}  // namespace detail

// Saves this device's pieces of the training state in `state` (as the SPMD program lays them out) as step
// `step`. Collective: every device of the communicator calls it.
template <Communicator C>
void save(const std::string& dir, const SpmdProgram& spmd, C& comm, const NamedArrays& state, std::int64_t step) {
  const std::string name = "step-" + std::to_string(step);
  const std::string where = dir + "/" + name;
  std::error_code ec;
  std::filesystem::create_directories(where, ec);
  if (!std::filesystem::is_directory(where))
    user_error("checkpoint: cannot create directory '" + where + "'" + (ec ? ": " + ec.message() : ""));

  std::string shard = "partir-shard 1 step " + std::to_string(step) + " device " + std::to_string(comm.device()) + "\n";
  for (const auto& b : spmd.inputs()) {
    if (!holds_state(spmd, b, comm.device())) continue;  // a pipeline stage saves its own
    auto it = state.find(b.name);
    if (it == state.end()) user_error("checkpoint save: the state has no '" + b.name + "'");
    const Array& a = it->second;
    shard += b.name + "\n" + std::string(name_of(a.dtype())) + " " + detail::shape_text(a.shape()) + " " +
             std::to_string(a.bytes()) + "\n";
    shard.append(reinterpret_cast<const char*>(layout::bytes(a)), static_cast<std::size_t>(a.bytes()));
  }
  detail::write_atomically(where + "/shard-" + std::to_string(comm.device()) + ".bin", shard);

  // Every shard's size and checksum to every device (as i32 halves: collectives carry numeric types).
  const std::uint64_t sum = detail::fnv1a(shard), size = shard.size();
  const std::int32_t mine[4] = {static_cast<std::int32_t>(size >> 32), static_cast<std::int32_t>(size & 0xffffffffu),
                                static_cast<std::int32_t>(sum >> 32), static_cast<std::int32_t>(sum & 0xffffffffu)};
  const int n = comm.num_devices();
  std::vector<std::int32_t> all(static_cast<std::size_t>(4 * n));
  Group world;
  for (int d = 0; d < n; ++d) world.devices.push_back(d);
  comm.all_gather(world, mine, all.data(), 4, DType::i32);

  if (comm.device() == 0) {
    auto u = [&](std::size_t i) { return static_cast<std::uint64_t>(static_cast<std::uint32_t>(all[i])); };
    std::string mesh;
    for (const auto& a : spmd.mesh().axes()) mesh += (mesh.empty() ? "" : ",") + a.name + "=" + std::to_string(a.size);
    std::string manifest = "partir-checkpoint 1\nstep " + std::to_string(step) + "\nmesh " + mesh + "\nprogram " +
                           spmd.name() + "\n";
    for (const auto& b : spmd.inputs())
      if (is_state(spmd, b))
        manifest += "tensor " + b.name + " " + std::string(name_of(b.global.dtype)) + " " +
                    detail::shape_text(b.global.shape) + " " + detail::dims_text(b.sharding) + "\n";
    for (int d = 0; d < n; ++d) {
      const auto i = static_cast<std::size_t>(4 * d);
      manifest += "shard " + std::to_string(d) + " " + std::to_string(u(i) << 32 | u(i + 1)) + " " +
                  detail::hex(u(i + 2) << 32 | u(i + 3)) + "\n";
    }
    detail::write_atomically(where + "/manifest.txt", manifest);
    detail::write_atomically(dir + "/LATEST", name + "\n");  // the commit point
    for (const auto& entry : std::filesystem::directory_iterator(dir))  // older checkpoints are superseded
      if (entry.is_directory() && entry.path().filename().string().starts_with("step-") &&
          entry.path().filename() != name)
        std::filesystem::remove_all(entry.path(), ec);
  }
  comm.barrier();  // no device goes on (or reads the checkpoint) before it is committed
}

// True if `dir` holds a committed checkpoint.
inline bool exists(const std::string& dir) { return std::filesystem::exists(dir + "/LATEST"); }

namespace detail {

struct Manifest {
  struct Tensor {
    std::string name;
    TensorType type;
    Sharding sharding;
  };
  std::string where;  // DIR/step-<N>
  std::int64_t step = 0;
  Mesh mesh;
  std::vector<Tensor> tensors;
  std::vector<std::pair<std::uint64_t, std::string>> shards;  // size, checksum
};

// The manifest of the latest checkpoint in `dir`, checked for form.
inline Manifest read_manifest(const std::string& dir) {
  const auto latest = read_file(dir + "/LATEST");
  if (!latest)
    user_error("checkpoint '" + dir + "': no LATEST file (nothing was saved here, or no save finished)");
  Manifest m;
  m.where = dir + "/" + latest->substr(0, latest->find('\n'));
  auto fail = [&](const std::string& why) -> Manifest { user_error("checkpoint '" + m.where + "': " + why); };
  const auto manifest_text = read_file(m.where + "/manifest.txt");
  if (!manifest_text) return fail("manifest.txt is missing (partial checkpoint)");
  bool has_mesh = false;
  std::stringstream lines(*manifest_text);
  std::string line;
  if (!std::getline(lines, line) || line != "partir-checkpoint 1")
    return fail("manifest.txt is not a partir checkpoint manifest (first line '" + line + "')");
  try {
    while (std::getline(lines, line)) {
      std::stringstream f(line);
      std::string key;
      f >> key;
      if (key == "step") {
        f >> m.step;
      } else if (key == "mesh") {
        std::string text;
        f >> text;
        m.mesh = Mesh::parse(text);
        has_mesh = true;
      } else if (key == "tensor") {
        std::string name, dtype, shape, dims;
        f >> name >> dtype >> shape >> dims;
        const TensorType type{parse_shape(shape), parse_dtype(dtype)};
        m.tensors.push_back({name, type, parse_dims(dims, type.rank())});
      } else if (key == "shard") {
        std::size_t d = 0;
        std::uint64_t size = 0;
        std::string sum;
        f >> d >> size >> sum;
        if (d != m.shards.size()) return fail("manifest.txt lists shard " + std::to_string(d) + " out of order");
        m.shards.emplace_back(size, sum);
      } else if (key != "program" && !key.empty()) {
        return fail("manifest.txt has an unknown line '" + line + "'");
      }
      if (f.fail()) return fail("manifest.txt has a malformed line '" + line + "'");
    }
  } catch (const std::logic_error&) {  // std::stoll
    return fail("manifest.txt has a malformed line '" + line + "'");
  }
  if (!has_mesh) return fail("manifest.txt names no mesh");
  if (static_cast<std::int64_t>(m.shards.size()) != m.mesh.num_devices())
    return fail("manifest.txt lists " + std::to_string(m.shards.size()) + " shards for mesh " + m.mesh.to_string());
  return m;
}

// Reads the shards one at a time (so at most one shard's bytes are held), checks each against the manifest,
// and calls piece(tensor, device, array) for every saved piece.
template <class Piece>
void for_each_piece(const Manifest& m, Piece&& piece) {
  auto fail = [&](const std::string& why) { user_error("checkpoint '" + m.where + "': " + why); };
  std::map<std::string, int> found;
  for (std::size_t d = 0; d < m.shards.size(); ++d) {
    const std::string file = "shard-" + std::to_string(d) + ".bin";
    const auto bytes = read_file(m.where + "/" + file);
    if (!bytes) fail(file + " is missing (partial checkpoint)");
    if (bytes->size() != m.shards[d].first)
      fail(file + " has " + std::to_string(bytes->size()) + " bytes, the manifest says " +
           std::to_string(m.shards[d].first) + " (truncated or partial checkpoint)");
    if (hex(fnv1a(*bytes)) != m.shards[d].second)
      fail(file + " is corrupted: checksum " + hex(fnv1a(*bytes)) + ", the manifest says " + m.shards[d].second);
    std::size_t at = bytes->find('\n') + 1;
    if (bytes->compare(0, at, "partir-shard 1 step " + std::to_string(m.step) + " device " + std::to_string(d) + "\n") != 0)
      fail(file + " belongs to another step or device");
    for (const auto& e : m.tensors) {
      // A pipeline stage's shard holds its own stage's tensors only, in the manifest's order.
      const auto name_end = bytes->find('\n', at);
      if (at >= bytes->size() || name_end == std::string::npos || bytes->compare(at, name_end - at, e.name) != 0) continue;
      const auto header_end = bytes->find('\n', name_end + 1);
      if (header_end == std::string::npos) fail(file + ": piece of '" + e.name + "' is malformed");
      ++found[e.name];
      std::stringstream header(bytes->substr(name_end + 1, header_end - name_end - 1));
      std::string dtype, shape;
      std::int64_t size = 0;
      header >> dtype >> shape >> size;
      Array a(TensorType{parse_shape(shape), parse_dtype(dtype)});
      at = header_end + 1;
      if (a.bytes() != size || at + static_cast<std::size_t>(size) > bytes->size())
        fail(file + ": piece of '" + e.name + "' is malformed");
      std::memcpy(layout::bytes(a), bytes->data() + at, static_cast<std::size_t>(size));
      at += static_cast<std::size_t>(size);
      if (local_shape(e.type, e.sharding, m.mesh) != a.shape())
        fail(file + ": piece of '" + e.name + "' is " + to_string(a.type()) + ", its layout " +
             to_string(e.type, e.sharding) + " on " + m.mesh.to_string() + " needs " +
             to_string(local_shape(e.type, e.sharding, m.mesh)));
      piece(e, static_cast<std::int64_t>(d), a);
    }
    if (at != bytes->size()) fail(file + " holds a piece the manifest does not list where it is");
  }
  for (const auto& e : m.tensors)
    if (!found[e.name]) fail("no shard holds '" + e.name + "' (partial checkpoint)");
}

}  // namespace detail

// Every tensor of the latest checkpoint in `dir` as a global array, and its step.
struct Loaded {
  std::int64_t step = 0;
  NamedArrays tensors;
};

inline Loaded load(const std::string& dir) {
  const detail::Manifest m = detail::read_manifest(dir);
  Loaded out{m.step, {}};
  for (const auto& e : m.tensors) out.tensors.emplace(e.name, Array(e.type));
  detail::for_each_piece(m, [&](const detail::Manifest::Tensor& e, std::int64_t device, const Array& piece) {
    layout::copy_overlap(piece, layout::piece_offset(e.type.shape, e.sharding, m.mesh, device), out.tensors.at(e.name),
                         std::vector<std::int64_t>(e.type.shape.size(), 0));
  });
  return out;
}

// Restores the latest checkpoint in `dir` into `state`: this device's piece of every parameter and optimizer
// state input of `spmd`, laid out as `spmd` wants (any mesh, any schedule). Returns the saved step. Each
// piece is assembled from the parts of the saved pieces that overlap it: no device holds a whole tensor.
template <Communicator C>
std::int64_t restore(const std::string& dir, const SpmdProgram& spmd, C& comm, NamedArrays& state) {
  const detail::Manifest m = detail::read_manifest(dir);
  const std::string what = "checkpoint '" + dir + "' (step " + std::to_string(m.step) + ")";
  struct Wanted {
    Array piece;
    std::vector<std::int64_t> offset;
  };
  std::map<std::string, Wanted> wanted;
  for (const auto& b : spmd.inputs()) {
    if (!holds_state(spmd, b, comm.device())) continue;
    auto e = std::find_if(m.tensors.begin(), m.tensors.end(), [&](const auto& t) { return t.name == b.name; });
    if (e == m.tensors.end()) user_error(what + " has no tensor '" + b.name + "' that program '" + spmd.name() + "' needs");
    if (e->type != b.global)
      user_error(what + ": tensor '" + b.name + "' is " + to_string(e->type) + " but program '" + spmd.name() +
                 "' needs " + to_string(b.global) +
                 (e->type.shape == b.global.shape
                      ? " (a checkpoint restores into its own dtypes: checkpoint::load it, convert, and shard_state)"
                      : ""));
    wanted[b.name] = {Array(spmd.type(b.value)), layout::piece_offset(b.global.shape, b.sharding, spmd.mesh(), comm.device())};
  }
  detail::for_each_piece(m, [&](const detail::Manifest::Tensor& e, std::int64_t device, const Array& piece) {
    if (auto it = wanted.find(e.name); it != wanted.end())
      layout::copy_overlap(piece, layout::piece_offset(e.type.shape, e.sharding, m.mesh, device), it->second.piece,
                           it->second.offset);
  });
  for (auto& [name, w] : wanted) state[name] = std::move(w.piece);
  return m.step;
}

}  // namespace partir::checkpoint
