// Sharded checkpoints: a resumed run continues the identical loss curve, a checkpoint restores onto another
// mesh and schedule, and damaged or partial checkpoints are UserErrors naming the file.
#include <doctest/doctest.h>

#include <partir/partir.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <unistd.h>

using namespace partir;
namespace fs = std::filesystem;

namespace {

Program adam_step() {
  nn::Mlp model{"params/mlp", {8, 16, 8}};
  return train_step([&](Tensor x, Tensor y) { return mse(model(x), y); }, Adam{1e-2}, {{"x", {16, 8}}, {"y", {16, 8}}});
}

NamedArrays batch(const Program& step, long s) {
  NamedArrays all = init_inputs(step, 100 + static_cast<std::uint64_t>(s), true), out;
  for (const char* name : {"x", "y"}) out.emplace(name, std::move(all.at(name)));
  return out;
}

// Runs steps [first, last] on the threads backend from the initial state (or from `dir` if resume), saving
// after step save_at; returns the losses.
std::vector<double> run(const Program& step, const SpmdProgram& spmd, long first, long last, const std::string& dir,
                        long save_at, bool resume) {
  std::vector<double> losses;
  threads::run(static_cast<int>(spmd.mesh().num_devices()), [&](threads::Communicator& c) {
    NamedArrays state;
    for (const auto& [name, global] : init_inputs(step, 0))
      for (const auto& b : spmd.inputs())
        if (b.name == name) state[name] = layout::shard(global, b.sharding, spmd.mesh(), c.device());
    if (resume && checkpoint::restore(dir, spmd, c, state) != first - 1) user_error("restored the wrong step");
    for (long s = first; s <= last; ++s) {
      for (auto& [name, global] : batch(step, s))
        for (const auto& b : spmd.inputs())
          if (b.name == name) state[name] = layout::shard(global, b.sharding, spmd.mesh(), c.device());
      DeviceResult r = execute(spmd, c, state, {.global_inputs = false, .global_outputs = false});
      if (c.device() == 0) losses.push_back(r.outputs.at("loss").at(0));
      carry_state(step, state, std::move(r.outputs));
      if (s == save_at) checkpoint::save(dir, spmd, c, state, s);
    }
  });
  return losses;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no UserError)";
}

struct TempDir {
  std::string path = (fs::temp_directory_path() / ("partir_checkpoint_" + std::to_string(::getpid()))).string();
  TempDir() { fs::remove_all(path); }
  ~TempDir() { fs::remove_all(path); }
};

}  // namespace

TEST_CASE("checkpoint: bf16 state saves and resumes bit for bit, the manifest naming its dtype") {
  const Program step = train_step([&](Tensor x, Tensor y) { return mse(nn::Mlp{"params/mlp", {8, 16, 8}}(x), y); },
                                  Adam{1e-2}, {{"x", {16, 8}}, {"y", {16, 8}}},
                                  MixedPrecision{DType::bf16, DType::bf16, DType::bf16, DType::f32});
  const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 2}, {"model", 2}}, parse_schedule("bp,mp,z3")));
  TempDir tmp;
  const std::string dir = tmp.path + "/bf16";
  const std::vector<double> full = run(step, spmd, 1, 4, dir, 2, false);
  CHECK(checkpoint::load(dir).tensors.at("params/mlp/w1").dtype() == DType::bf16);
  CHECK(checkpoint::load(dir).tensors.at("opt/adam/m/params/mlp/w1").dtype() == DType::bf16);
  const std::vector<double> resumed = run(step, spmd, 3, 4, dir, 0, true);
  CHECK(std::isfinite(full.back()));
  CHECK(full.back() < full.front());
  CHECK(resumed == std::vector<double>(full.begin() + 2, full.end()));
}

TEST_CASE("checkpoint: resume, reshard onto another mesh and schedule, and damage detection") {
  const Program step = adam_step();
  const SpmdProgram spmd = lower(partition(step, Mesh{{"batch", 2}, {"model", 2}},
                                           {data_parallel("batch"), megatron("model"), zero3("batch")}));
  TempDir tmp;
  const std::string dir = tmp.path + "/run";
  const auto full = run(step, spmd, 1, 6, dir, 3, false);
  REQUIRE(full.size() == 6);
  CHECK(checkpoint::exists(dir));

  // The same plan resumed from step 3: bit-identical losses for steps 4..6.
  const auto resumed = run(step, spmd, 4, 6, dir, 0, true);
  REQUIRE(resumed.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) CHECK(resumed[i] == full[i + 3]);

  // The saved tensors are the single-device state after 3 steps.
  {
    NamedArrays state = init_inputs(step, 0);
    for (long s = 1; s <= 3; ++s) {
      NamedArrays in = state;
      for (auto& [name, a] : batch(step, s)) in[name] = a;
      carry_state(step, state, interpret(step, in));
    }
    const checkpoint::Loaded loaded = checkpoint::load(dir);
    CHECK(loaded.step == 3);
    CHECK(loaded.tensors.size() == state.size());
    for (const auto& [name, want] : state) {
      const Array& got = loaded.tensors.at(name);
      REQUIRE(got.type() == want.type());
      for (std::int64_t i = 0; i < want.size(); ++i) CHECK(got.at(i) == doctest::Approx(want.at(i)).epsilon(1e-5));
    }
  }

  // Another mesh and schedule: the checkpoint is resharded; the losses agree up to summation order.
  const SpmdProgram other = lower(partition(step, Mesh{{"batch", 4}}, {data_parallel("batch"), zero2("batch")}));
  const auto moved = run(step, other, 4, 6, dir, 0, true);
  REQUIRE(moved.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) CHECK(moved[i] == doctest::Approx(full[i + 3]).epsilon(1e-5));

  // A save that died before its commit (a later step's directory, half written) leaves LATEST at step 3.
  fs::create_directories(dir + "/step-5");
  std::ofstream(dir + "/step-5/shard-0.bin") << "partial";
  CHECK(run(step, spmd, 4, 4, dir, 0, true)[0] == full[3]);

  const std::string at = "checkpoint '" + dir + "/step-3': ";
  auto restore_here = [&] { run(step, spmd, 4, 4, dir, 0, true); };
  auto copy = [&](const std::string& name) { fs::copy_file(dir + "/step-3/" + name, tmp.path + "/" + name, fs::copy_options::overwrite_existing); };
  auto put_back = [&](const std::string& name) { fs::copy_file(tmp.path + "/" + name, dir + "/step-3/" + name, fs::copy_options::overwrite_existing); };

  // A corrupted shard (one byte flipped).
  copy("shard-1.bin");
  {
    std::fstream f(dir + "/step-3/shard-1.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  CHECK(message_of(restore_here).starts_with(at + "shard-1.bin is corrupted: checksum "));
  put_back("shard-1.bin");
  // A truncated shard.
  const auto size = fs::file_size(dir + "/step-3/shard-0.bin");
  copy("shard-0.bin");
  fs::resize_file(dir + "/step-3/shard-0.bin", size - 10);
  CHECK(message_of(restore_here) == at + "shard-0.bin has " + std::to_string(size - 10) + " bytes, the manifest says " +
                                        std::to_string(size) + " (truncated or partial checkpoint)");
  put_back("shard-0.bin");
  // A missing shard and a missing manifest.
  copy("shard-2.bin");
  fs::remove(dir + "/step-3/shard-2.bin");
  CHECK(message_of(restore_here) == at + "shard-2.bin is missing (partial checkpoint)");
  put_back("shard-2.bin");
  copy("manifest.txt");
  fs::remove(dir + "/step-3/manifest.txt");
  CHECK(message_of(restore_here) == at + "manifest.txt is missing (partial checkpoint)");
  put_back("manifest.txt");
  CHECK(run(step, spmd, 4, 4, dir, 0, true)[0] == full[3]);  // repaired

  // A program whose parameters differ from the checkpoint's.
  nn::Mlp wider{"params/mlp", {8, 32, 8}};
  const Program wide = train_step([&](Tensor x, Tensor y) { return mse(wider(x), y); }, Adam{1e-2},
                                  {{"x", {16, 8}}, {"y", {16, 8}}});
  const SpmdProgram wide_spmd = lower(partition(wide, Mesh{{"batch", 2}}, {data_parallel("batch")}));
  CHECK(message_of([&] { run(wide, wide_spmd, 4, 4, dir, 0, true); }) ==
        "checkpoint '" + dir + "' (step 3): tensor 'params/mlp/w1' is f32[8,16] but program 'train_step' needs "
        "f32[8,32]");
  // E83 a program whose parameters have another dtype (bf16 master weights): never converted implicitly.
  const Program bf16_step = train_step([&](Tensor x, Tensor y) { return mse(nn::Mlp{"params/mlp", {8, 16, 8}}(x), y); },
                                       Adam{1e-2}, {{"x", {16, 8}}, {"y", {16, 8}}},
                                       MixedPrecision{DType::bf16, DType::bf16, DType::bf16, DType::f32});
  const SpmdProgram bf16_spmd = lower(partition(bf16_step, Mesh{{"batch", 2}}, {data_parallel("batch")}));
  CHECK(message_of([&] { run(bf16_step, bf16_spmd, 4, 4, dir, 0, true); }) ==
        "checkpoint '" + dir + "' (step 3): tensor 'params/mlp/w1' is f32[8,16] but program 'train_step' needs "
        "bf16[8,16] (a checkpoint restores into its own dtypes: checkpoint::load it, convert, and shard_state)");
  // No checkpoint at all.
  CHECK(message_of([&] { checkpoint::load(tmp.path + "/none"); }) ==
        "checkpoint '" + tmp.path + "/none': no LATEST file (nothing was saved here, or no save finished)");
}
