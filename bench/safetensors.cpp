// safetensors save and restore of a Llama's weights (runtime/state/safetensors.hpp) against the plain file I/O
// of the same bytes, measured in the same run: one sequential write of every parameter (then fsync) and one
// sequential read. partir's saves are 4 devices writing their own pieces of a bp,mp,z3 plan (and one process
// writing whole tensors, and bf16 files); its restores read each device's pieces for another plan (mp on 4)
// from the mapped files. Ratios near 1 mean the format and the piecewise writes cost nothing over the disk.
//   build/bench/safetensors [--layers 4] [--dmodel 512] [--vocab 32000] [--dir /tmp]
#include <partir/partir.hpp>
#include <partir/runtime/state/safetensors.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

namespace p = partir;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Each device's pieces of the parameters under `spmd`.
std::vector<p::NamedArrays> pieces(const p::SpmdProgram& spmd, const p::NamedArrays& params) {
  std::vector<p::NamedArrays> out(static_cast<std::size_t>(spmd.mesh().num_devices()));
  for (std::int64_t d = 0; d < spmd.mesh().num_devices(); ++d)
    for (const auto& b : spmd.inputs())
      if (params.contains(b.name)) out[static_cast<std::size_t>(d)][b.name] = p::layout::shard(params.at(b.name), b.sharding, spmd.mesh(), d);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  long layers = 4, dmodel = 512, vocab = 32000;
  std::string base = std::filesystem::temp_directory_path().string();
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--layers") layers = std::stol(argv[i + 1]);
    else if (flag == "--dmodel") dmodel = std::stol(argv[i + 1]);
    else if (flag == "--vocab") vocab = std::stol(argv[i + 1]);
    else if (flag == "--dir") base = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: safetensors [--layers N] [--dmodel D] [--vocab V] [--dir DIR]\n");
      return 2;
    }
  }
  const std::string dir = base + "/partir-bench-safetensors-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const p::nn::Llama model{{.vocab = vocab, .seq = 16, .d_model = dmodel, .layers = layers, .heads = 8, .kv_heads = 2,
                            .ffn = (8 * dmodel / 3 + 31) / 32 * 32}};
  const p::Program forward = p::trace("llama", [&](p::Tensor t) { return p::NamedTensors{{"logits", model.logits(t)}}; },
                                      {{"tokens", {4, 16}, p::DType::i32}});
  p::NamedArrays params = p::init_inputs(forward, 1);
  params.erase("tokens");
  std::int64_t bytes = 0;
  for (const auto& [name, a] : params) bytes += a.bytes();
  const double gb = static_cast<double>(bytes) / 1e9;
  std::printf("Llama %ld layers, d_model %ld, vocab %ld: %zu tensors, %.1f MB f32, in %s\n", layers, dmodel, vocab,
              params.size(), static_cast<double>(bytes) / 1e6, dir.c_str());

  // Baselines: the same bytes through one file, sequentially.
  auto t0 = std::chrono::steady_clock::now();
  {
    const int fd = ::open((dir + "/baseline.bin").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    for (const auto& [name, a] : params)
      if (::write(fd, p::layout::bytes(a), static_cast<std::size_t>(a.bytes())) != a.bytes()) return 1;
    ::fsync(fd);
    ::close(fd);
  }
  const double write_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  {
    p::NamedArrays back;
    std::ifstream in(dir + "/baseline.bin", std::ios::binary);
    for (const auto& [name, a] : params) {
      p::Array b(a.type());
      in.read(reinterpret_cast<char*>(p::layout::bytes(b)), static_cast<std::streamsize>(b.bytes()));
      back.emplace(name, std::move(b));
    }
  }
  const double read_s = seconds_since(t0);
  std::printf("baseline: sequential write + fsync %.1f ms (%.2f GB/s), sequential read %.1f ms (%.2f GB/s)\n",
              write_s * 1e3, gb / write_s, read_s * 1e3, gb / read_s);

  // Saves under bp,mp,z3 on 2x2: every device writes its own pieces.
  const p::SpmdProgram saved_by = p::lower(p::partition(forward, p::Mesh{{"batch", 2}, {"model", 2}}, p::parse_schedule("bp,mp,z3")));
  const std::vector<p::NamedArrays> saved_pieces = pieces(saved_by, params);
  double save_s = 0;
  p::threads::run(4, [&](p::threads::Communicator& comm) {
    comm.barrier();
    const auto start = std::chrono::steady_clock::now();
    p::save_safetensors(dir + "/sharded", saved_by, comm, saved_pieces[static_cast<std::size_t>(comm.device())]);
    if (comm.device() == 0) save_s = seconds_since(start);
  });
  t0 = std::chrono::steady_clock::now();
  p::save_safetensors(dir + "/whole", params);
  const double whole_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  p::save_safetensors(dir + "/bf16", params, {.dtype = p::DType::bf16});
  const double bf16_s = seconds_since(t0);

  // Restores onto mp on 4 devices, from the files 4 devices wrote; and whole tensors.
  const p::SpmdProgram restored_by = p::lower(p::partition(forward, p::Mesh{{"model", 4}}, p::parse_schedule("mp")));
  double restore_s = 0, restore_bf16_s = 0;
  bool equal = true;
  const std::vector<p::NamedArrays> wanted = pieces(restored_by, params);
  p::threads::run(4, [&](p::threads::Communicator& comm) {
    p::NamedArrays state;
    comm.barrier();
    auto start = std::chrono::steady_clock::now();
    p::restore_safetensors(dir + "/sharded", restored_by, comm, state);
    comm.barrier();
    if (comm.device() == 0) restore_s = seconds_since(start);
    if (state != wanted[static_cast<std::size_t>(comm.device())]) equal = false;
    start = std::chrono::steady_clock::now();
    p::restore_safetensors(dir + "/bf16", restored_by, comm, state);
    comm.barrier();
    if (comm.device() == 0) restore_bf16_s = seconds_since(start);
  });
  t0 = std::chrono::steady_clock::now();
  const bool whole_equal = p::load_safetensors(dir + "/whole") == params;
  const double load_s = seconds_since(t0);
  std::filesystem::remove_all(dir);

  std::printf("save, 4 devices writing their pieces (bp,mp,z3 on 2x2): %.1f ms (%.2f GB/s)\n", save_s * 1e3, gb / save_s);
  std::printf("save, one process, whole tensors: %.1f ms; in bf16: %.1f ms\n", whole_s * 1e3, bf16_s * 1e3);
  std::printf("restore onto mp on 4 devices: %.1f ms (%.2f GB/s)%s; from bf16 files: %.1f ms\n", restore_s * 1e3,
              gb / restore_s, equal ? "" : " WRONG PIECES", restore_bf16_s * 1e3);
  std::printf("load whole tensors: %.1f ms%s\n", load_s * 1e3, whole_equal ? "" : " WRONG VALUES");
  std::printf("save (4 devices) / sequential write: %.2f\n", save_s / write_s);
  std::printf("restore (4 devices) / sequential read: %.2f\n", restore_s / read_s);
  return equal && whole_equal ? 0 : 1;
}
