#pragma once
// What gpt_train, llama_train and gpt_infer share: the byte corpus and its batches, the programs (train, eval,
// --predict, the next token that generation asks for) of either model, and the choice of the next byte.
#include <partir/partir.hpp>
#include <partir/runtime/state/safetensors.hpp>

#include "recipe.hpp"

#include <cmath>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>

namespace gpt {

namespace p = partir;

// examples/data/corpus.txt: synthetic text written by tools/make_corpus.py (see examples/data/README.md).
inline std::string load_corpus(const std::string& path, std::int64_t seq) {
  std::ifstream f(path, std::ios::binary);
  if (!f) p::user_error("--corpus: cannot read '" + path + "'");
  std::ostringstream text;
  text << f.rdbuf();
  if (static_cast<std::int64_t>(text.str().size()) <= seq + 1)
    p::user_error("--corpus: '" + path + "' is shorter than one window of " + std::to_string(seq + 1) + " bytes");
  return text.str();
}

// Bytes [offset, offset + seq) of the text as token ids.
inline void window(const std::string& text, std::size_t offset, std::int64_t seq, std::int32_t* out) {
  for (std::int64_t i = 0; i < seq; ++i) out[i] = static_cast<unsigned char>(text[offset + static_cast<std::size_t>(i)]);
}

// Global inputs of step `step`: `batch` windows at offsets drawn from (seed, step), so every device builds the
// same batch; targets are the tokens shifted by one byte. std::mt19937_64's output is fixed by the standard.
inline p::NamedArrays batch_at(const std::string& text, std::int64_t batch, std::int64_t seq, std::uint64_t seed,
                               long step) {
  std::mt19937_64 rng(seed * 1000003 + static_cast<std::uint64_t>(step));
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(batch * seq)), targets(tokens.size());
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::size_t offset = rng() % (text.size() - static_cast<std::size_t>(seq) - 1);
    window(text, offset, seq, &tokens[static_cast<std::size_t>(b * seq)]);
    window(text, offset + 1, seq, &targets[static_cast<std::size_t>(b * seq)]);
  }
  return {{"tokens", p::Array({batch, seq}, std::move(tokens))}, {"targets", p::Array({batch, seq}, std::move(targets))}};
}

template <class Model>  // nn::Gpt or nn::Llama
p::Program train_program(const Model& model, std::int64_t batch, const examples::Recipe& recipe,
                                 const p::MixedPrecision& precision = {}) {
  const auto seq = model.config.seq;
  return recipe.train_step([&](p::Tensor tokens, p::Tensor targets) { return model.loss(tokens, targets); },
                           {{"tokens", {batch, seq}, p::DType::i32}, {"targets", {batch, seq}, p::DType::i32}}, precision);
}

// The loss alone (forward only), on the parameters a train program updates: the validation program.
template <class Model>
p::Program eval_program(const Model& model, std::int64_t batch, const p::MixedPrecision& precision = {}) {
  const auto seq = model.config.seq;
  const p::PrecisionScope policy(precision);
  return p::trace(
      "gpt_eval",
      [&](p::Tensor tokens, p::Tensor targets) {
        return p::NamedTensors{{"loss", p::convert(model.loss(tokens, targets), precision.output)}};
      },
      {{"tokens", {batch, seq}, p::DType::i32}, {"targets", {batch, seq}, p::DType::i32}});
}

// Splits the corpus: the first (1 - holdout) for training, the rest for validation (each longer than a window).
inline std::pair<std::string, std::string> split_corpus(const std::string& text, double holdout, std::int64_t seq) {
  if (!(holdout >= 0 && holdout < 1)) p::user_error("--holdout: expected a fraction in [0, 1), got " + std::to_string(holdout));
  const auto cut = static_cast<std::size_t>(static_cast<double>(text.size()) * (1 - holdout));
  const auto window = static_cast<std::size_t>(seq) + 1;
  if (holdout > 0 && (cut <= window || text.size() - cut <= window))
    p::user_error("--holdout " + std::to_string(holdout) + ": both parts of the corpus (" + std::to_string(text.size()) +
                  " bytes) must hold a window of " + std::to_string(window) + " bytes");
  return {text.substr(0, cut), text.substr(cut)};
}

// tokens and targets [batch, seq] -> "logits" [batch, seq, vocab] (in the compute dtype) and "loss" (f32):
// what --predict computes.
template <class Model>
p::Program predict_program(const Model& model, std::int64_t batch, const p::MixedPrecision& precision = {}) {
  const auto seq = model.config.seq;
  const p::PrecisionScope policy(precision);
  return p::trace(
      "predict",
      [&](p::Tensor tokens, p::Tensor targets) {
        const p::Tensor logits = model.logits(tokens);
        return p::NamedTensors{{"logits", logits}, {"loss", p::cross_entropy(logits, targets)}};
      },
      {{"tokens", {batch, seq}, p::DType::i32}, {"targets", {batch, seq}, p::DType::i32}});
}

// --predict FILE: the trained model (`state`: whole parameters) on the batch in FILE (i32 tokens and targets
// [batch, seq]), written to `out`: logits, loss and the loss's gradient of each parameter as grad.<tensor name>,
// what another framework's forward pass and autograd must agree with (tests/llama_vs_torch.py).
template <class Model>
void write_predictions(const Model& model, const p::NamedArrays& state, const std::string& file, const std::string& out,
                       const p::MixedPrecision& precision) {
  p::NamedArrays feed = p::safetensors::read(file), predictions;
  for (const char* name : {"tokens", "targets"})
    if (!feed.contains(name) || feed.at(name).dtype() != p::DType::i32 || feed.at(name).shape().size() != 2 ||
        feed.at(name).shape()[1] != model.config.seq)
      p::user_error("--predict " + file + ": needs i32 '" + name + "' [batch, " + std::to_string(model.config.seq) + "]");
  const p::Program program = p::value_and_grad(predict_program(model, feed.at("tokens").shape()[0], precision), "loss");
  for (const auto& [name, a] : state)
    if (program.find_input(name)) feed.insert_or_assign(name, a);
  for (auto& [name, a] : p::interpret(program, feed))
    predictions.emplace(name.starts_with("grad/") ? "grad." + p::safetensors::tensor_name(name.substr(5)) : name, std::move(a));
  p::safetensors::write(out, predictions);
  std::cout << "predictions of " << file << " in " << out << std::endl;
}

// tokens [batch, seq] -> "logits" [batch, vocab] of the byte after each window. Generation slides the window
// along the text, so the program keeps one shape.
template <class Model>
p::Program next_token_program(const Model& model, std::int64_t batch) {
  const auto seq = model.config.seq, vocab = model.config.vocab;
  return p::trace(
      "gpt_next_token",
      [&](p::Tensor tokens) {
        const p::Tensor last = p::slice(model.logits(tokens), {0, seq - 1, 0}, {batch, seq, vocab});
        return p::NamedTensors{{"logits", p::reshape(last, {batch, vocab})}};
      },
      {{"tokens", {batch, seq}, p::DType::i32}});
}

// The next byte from one row of logits: the most likely at temperature 0, else a draw from softmax(logits / T).
inline std::int32_t pick(const p::Array& logits, std::int64_t row, double temperature, std::mt19937_64& rng) {
  const std::int64_t vocab = logits.shape().back();
  const auto at = [&](std::int64_t j) { return logits.at(row * vocab + j); };
  std::int64_t best = 0;
  for (std::int64_t j = 1; j < vocab; ++j)
    if (at(j) > at(best)) best = j;
  if (temperature <= 0) return static_cast<std::int32_t>(best);
  std::vector<double> weights(static_cast<std::size_t>(vocab));
  for (std::int64_t j = 0; j < vocab; ++j) weights[static_cast<std::size_t>(j)] = std::exp((at(j) - at(best)) / temperature);
  double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * std::accumulate(weights.begin(), weights.end(), 0.0);
  for (std::int64_t j = 0; j < vocab; ++j)
    if ((u -= weights[static_cast<std::size_t>(j)]) < 0) return static_cast<std::int32_t>(j);
  return static_cast<std::int32_t>(vocab - 1);
}

// Printable form of generated bytes (the corpus is ASCII; anything else shows as '?').
inline std::string printable(const std::vector<std::int32_t>& bytes) {
  std::string s;
  for (auto b : bytes) s += (b == '\n' || (b >= 32 && b < 127)) ? static_cast<char>(b) : '?';
  return s;
}

}  // namespace gpt
