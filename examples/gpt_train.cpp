// Trains a byte-level GPT (nn::Gpt: token + position embedding, pre-LayerNorm attention and GELU MLP blocks,
// tied output projection) on examples/data/corpus.txt. The train step (forward, backward, Adam) is one partir
// Program; the schedule partitions it over the mesh, and the same SPMD program runs on N threads of this
// process or on N MPI ranks. --sample N then generates N bytes greedily (or at --temperature) with a
// forward-only program.
//   build/examples/gpt_train --steps 300 --sample 200
//   build/examples/gpt_train --mesh batch=2,model=2 --schedule bp,mp,z3,emb
//   mpirun -np 4 build/examples/gpt_train --backend mpi --mesh batch=2,model=2 --schedule bp,mp,z3
#include <partir/partir.hpp>

#include "cli.hpp"
#include "gpt_common.hpp"
#include "training_loop.hpp"

namespace p = partir;

int main(int argc, char** argv) {
  cli::Args args(argc, argv, "usage: gpt_train [flags]\nTrains a byte-level GPT on a text file with partir.");
  const long steps = args.get_int("steps", 300, "training steps");
  const long batch = args.get_int("batch", 16, "sequences per step (global)");
  const long seq = args.get_int("seq", 64, "context length in bytes");
  const long layers = args.get_int("layers", 2, "transformer blocks");
  const long dmodel = args.get_int("dmodel", 64, "model width");
  const long heads = args.get_int("heads", 4, "attention heads");
  const long tied = args.get_int("tied", 1, "1: output projection is the token table; 0: its own weights");
  const long seed = args.get_int("seed", 0, "seed of parameters, batches and sampling");
  const double lr = args.get_double("lr", 3e-3, "Adam learning rate");
  const std::string corpus_path = args.get("corpus", PARTIR_GPT_CORPUS, "training text");
  const std::string mesh_text = args.get("mesh", "batch=1", "device mesh, axes major to minor");
  const std::string schedule_text =
      args.get("schedule", "none", "tactics in order: bp, mp, z2, z3, emb, auto:model (comma-separated)");
  const std::string backend = args.get("backend", "threads", "threads (one process), mpi (under mpirun) or nccl (one GPU per device)");
  const std::string report = args.get("report", "", "'json' writes a JSON report of the run");
  const std::string report_file = args.get("report-file", "gpt_train_report.json", "where --report json writes");
  const long sample = args.get_int("sample", 0, "bytes to generate after training");
  const double temperature = args.get_double("temperature", 0, "sampling temperature; 0 picks the likeliest byte");
  const long log_every = examples::log_every_flag(args, steps);
  const p::MixedPrecision precision = examples::precision_flag(args);
  const examples::CheckpointOptions checkpoint = examples::checkpoint_flags(args);
  args.finish();

  try {
    if (!report.empty() && report != "json") p::user_error("--report: expected 'json', got '" + report + "'");
    const p::nn::Gpt model{{.vocab = 256, .seq = seq, .d_model = dmodel, .heads = heads, .layers = layers,
                            .tied = tied != 0}};
    const std::string text = gpt::load_corpus(corpus_path, seq);
    const p::Program step = gpt::train_program(model, batch, lr, precision);
    const p::Mesh mesh = p::Mesh::parse(mesh_text);
    const p::SpmdProgram spmd = p::lower(examples::partition_and_report(step, mesh, p::parse_schedule(schedule_text)));
    const examples::LoopOptions options{steps, static_cast<std::uint64_t>(seed), batch * seq,
                                        report == "json" ? report_file : "",
                                        "gpt_train mesh " + mesh.to_string() + " schedule " + schedule_text +
                                            " backend " + backend + " precision " + std::string(name_of(precision.compute)),
                                        checkpoint, log_every};
    auto next_batch = [&](long s) { return gpt::batch_at(text, batch, seq, static_cast<std::uint64_t>(seed), s); };

    auto run = [&]<p::Communicator C>(C& comm) {
      const p::Executable exe(spmd, comm);
      const examples::Trained trained = examples::train(exe, next_batch, options);
      if (sample <= 0) return;
      p::NamedArrays state = exe.gather_state(trained.state);
      if (comm.device() != 0) return;
      // Continue the corpus's first window, one byte at a time, on this device, with the trained parameters.
      const p::Program next = gpt::next_token_program(model, 1);
      std::erase_if(state, [&](const auto& kv) { return !next.find_input(kv.first); });
      std::vector<std::int32_t> window(static_cast<std::size_t>(seq)), generated;
      gpt::window(text, 0, seq, window.data());
      std::mt19937_64 rng(static_cast<std::uint64_t>(seed));
      for (long i = 0; i < sample; ++i) {
        state["tokens"] = p::Array({1, seq}, window);
        const auto b = gpt::pick(p::interpret(next, state).at("logits"), 0, temperature, rng);
        generated.push_back(b);
        window.erase(window.begin());
        window.push_back(b);
      }
      std::cout << "prompt: " << text.substr(0, static_cast<std::size_t>(seq)) << "\nsample: "
                << gpt::printable(generated) << std::endl;
    };

    examples::run_on_backend(backend, mesh.num_devices(), argc, argv, run);
  } catch (const p::UserError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
