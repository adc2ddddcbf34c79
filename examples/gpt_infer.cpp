// Multi-query attention decoding: trains a byte-level GPT whose attention shares one K/V head across its query
// heads (nn::GptConfig::multi_query), then continues several prompts at once with a forward-only next-token
// program partitioned by the multi_query preset (MQ: query heads and the MLP split on the model axis, the one
// K/V head whole on every device). Each step recomputes the window of the last --seq bytes (no K/V cache).
// Prints the collective plan of the decode program, the continuations, decode tokens/s, and how far the
// partitioned logits are from the single-device program's.
//   build/examples/gpt_infer
//   build/examples/gpt_infer --mesh batch=2,model=2 --schedule mq --train-schedule bp,mq
//   mpirun -np 2 build/examples/gpt_infer --backend mpi
#include <partir/partir.hpp>
#include <partir/sim/json.hpp>

#include "cli.hpp"
#include "gpt_common.hpp"
#include "training_loop.hpp"

namespace p = partir;

namespace {

// "all_reduce{model} x4, ..." for collectives that communicate (all_slice is a local copy).
std::string plan_summary(const p::SpmdProgram& spmd) {
  std::map<std::string, int> count;
  for (const auto& c : spmd.collectives())
    if (c.collective.kind != p::CollectiveKind::all_slice)
      ++count[std::string(p::name_of(c.collective.kind)) + p::to_string(c.collective.axes)];
  std::string s;
  for (const auto& [what, n] : count) s += (s.empty() ? "" : ", ") + what + " x" + std::to_string(n);
  return s.empty() ? "no communication" : s;
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app("Trains a multi-query GPT, then decodes with the MQ sharding.", "gpt_infer");
  long steps = 200, batch = 16, seq = 64, layers = 2, dmodel = 64, heads = 4, prompts = 4, tokens = 48, seed = 0;
  double lr = 3e-3, temperature = 0;
  std::string corpus_path = PARTIR_GPT_CORPUS, train_schedule_text = "mq";
  app.add_option("--steps", steps, "training steps before decoding")->check(cli::at_least(1));
  app.add_option("--batch", batch, "training sequences per step (global)")->check(cli::at_least(1));
  app.add_option("--seq", seq, "context length in bytes")->check(cli::at_least(1));
  app.add_option("--layers", layers, "transformer blocks")->check(cli::at_least(1));
  app.add_option("--dmodel", dmodel, "model width")->check(cli::at_least(1));
  app.add_option("--heads", heads, "query heads (one shared K/V head)")->check(cli::at_least(1));
  app.add_option("--prompts", prompts, "prompts decoded together (the decode batch)")->check(cli::at_least(1));
  app.add_option("--tokens", tokens, "bytes generated per prompt")->check(cli::at_least(1));
  app.add_option("--seed", seed, "seed of parameters, batches, prompts and sampling");
  app.add_option("--lr", lr, "Adam learning rate")->check(cli::at_least(0));
  app.add_option("--temperature", temperature, "sampling temperature; 0 picks the likeliest byte")->check(cli::at_least(0));
  app.add_option("--corpus", corpus_path, "training text");
  const examples::RunFlags flags(app, "model=2", "mq", "decode tactics: bp, mq, ... (comma-separated)",
                                 "gpt_infer_report.json");
  app.add_option("--train-schedule", train_schedule_text, "training tactics (comma-separated)");
  app.parse(argc, argv);
  const std::string &mesh_text = flags.mesh, &schedule_text = flags.schedule, &backend = flags.backend;
  const std::string &report = flags.report, &report_file = flags.report_file;
  const examples::CheckpointOptions& checkpoint = flags.checkpoint;

  try {
    const p::nn::Gpt model{{.vocab = 256, .seq = seq, .d_model = dmodel, .heads = heads, .layers = layers,
                            .multi_query = true}};
    const std::string text = gpt::load_corpus(corpus_path, seq);
    const p::Mesh mesh = p::Mesh::parse(mesh_text);
    examples::Recipe recipe;
    recipe.lr = lr;
    const p::Program step = gpt::train_program(model, batch, recipe);
    const p::SpmdProgram train_spmd = p::lower(p::partition(step, mesh, p::parse_schedule(train_schedule_text)));
    const p::Program next = gpt::next_token_program(model, prompts);
    const p::SpmdProgram decode = p::lower(p::partition(next, mesh, p::parse_schedule(schedule_text)));
    const examples::LoopOptions options{steps, static_cast<std::uint64_t>(seed), batch * seq, "",
                                        "gpt_infer training", checkpoint, 1, recipe};
    auto next_batch = [&](long s) { return gpt::batch_at(text, batch, seq, static_cast<std::uint64_t>(seed), s); };

    auto run = [&]<p::Communicator C>(C& comm) {
      const bool lead = comm.device() == 0;
      const p::Executable trainer(train_spmd, comm);
      const auto trained = examples::train(trainer, next_batch, options);
      p::NamedArrays params = trainer.gather_state(trained.state);
      std::erase_if(params, [&](const auto& kv) { return !next.find_input(kv.first); });  // no optimizer state
      const p::Executable decoder(decode, comm);
      p::NamedArrays local = decoder.shard_state(params);
      // Prompts: windows of the corpus at offsets drawn from the seed (the same on every device).
      std::mt19937_64 rng(static_cast<std::uint64_t>(seed) + 1);
      std::vector<std::int32_t> windows(static_cast<std::size_t>(prompts * seq));
      std::vector<std::string> prompt_text;
      std::vector<std::vector<std::int32_t>> generated(static_cast<std::size_t>(prompts));
      for (long i = 0; i < prompts; ++i) {
        const std::size_t offset = rng() % (text.size() - static_cast<std::size_t>(seq));
        gpt::window(text, offset, seq, &windows[static_cast<std::size_t>(i * seq)]);
        prompt_text.push_back(text.substr(offset, static_cast<std::size_t>(seq)));
      }
      if (lead) std::cout << "decode plan (" << schedule_text << " on " << mesh.to_string() << "): " << plan_summary(decode) << std::endl;
      double max_diff = 0;
      std::int64_t peak = 0;
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      for (long t = 0; t < tokens; ++t) {
        const p::Array window({prompts, seq}, windows);
        const p::DeviceResult r = decoder.step(local, {{"tokens", window}});
        peak = std::max(peak, r.peak_bytes);
        const p::Array& logits = r.outputs.at("logits");
        if (t == 0 && lead) {  // the partitioned program against the single-device one, once
          params["tokens"] = window;
          const p::Array expect = p::interpret(next, params).at("logits");
          for (std::int64_t i = 0; i < expect.size(); ++i) max_diff = std::max(max_diff, std::abs(expect.at(i) - logits.at(i)));
        }
        for (long i = 0; i < prompts; ++i) {
          const std::int32_t b = gpt::pick(logits, i, temperature, rng);
          generated[static_cast<std::size_t>(i)].push_back(b);
          auto row = windows.begin() + i * seq;
          std::copy(row + 1, row + seq, row);
          *(row + seq - 1) = b;
        }
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!lead) return;
      for (long i = 0; i < prompts; ++i)
        std::cout << "--- prompt " << i << ": " << prompt_text[static_cast<std::size_t>(i)] << "\n--- continues: "
                  << gpt::printable(generated[static_cast<std::size_t>(i)]) << "\n";
      const double per_s = static_cast<double>(prompts * tokens) / seconds;
      std::cout << "decoded " << prompts * tokens << " bytes in " << seconds << " s: " << per_s << " tokens/s, "
                << 1e3 * seconds / static_cast<double>(tokens) << " ms per step\n"
                << "max |partitioned - single-device| logit difference at step 1: " << max_diff << std::endl;
      if (report != "json") return;
      p::json::write_file(report_file,
                          {{"run", "gpt_infer mesh " + mesh.to_string() + " schedule " + schedule_text + " backend " + backend},
                           {"tokens_per_s", per_s}, {"ms_per_step", 1e3 * seconds / static_cast<double>(tokens)},
                           {"peak_bytes_device0", peak}, {"max_logit_difference", max_diff},
                           {"collectives", examples::collectives_json(decode)}});
      std::cout << "report written to " << report_file << std::endl;
    };

    examples::run_on_backend(backend, mesh.num_devices(), argc, argv, run);
  } catch (const p::UserError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
