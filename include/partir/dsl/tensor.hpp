#pragma once
// Tensor: a cheap handle to a value of the program being traced. Model code calls operators and free
// functions on Tensors; each call appends an op to the program (the model never names a device or a layout).
#include <string>

#include "partir/dsl/precision.hpp"
#include "partir/ir/program.hpp"

namespace partir {

class Tensor {
 public:
  Tensor(Program& program, ValueId id) : program_(&program), id_(id) {}

  ValueId id() const { return id_; }
  Program& program() const { return *program_; }
  const TensorType& type() const { return program_->type(id_); }
  const Shape& shape() const { return type().shape; }
  DType dtype() const { return type().dtype; }
  std::int64_t rank() const { return type().rank(); }
  // Size of dim d; negative d counts from the end.
  std::int64_t dim(std::int64_t d) const {
    const auto i = d < 0 ? d + rank() : d;
    if (i < 0 || i >= rank())
      user_error("Tensor " + to_string(type()) + ": dim " + std::to_string(d) + " is out of range for rank " +
                 std::to_string(rank()));
    return shape()[static_cast<std::size_t>(i)];
  }

 private:
  Program* program_;
  ValueId id_;
};

// The program that input()/param() append to while a function is traced (one per thread).
class TraceScope {
 public:
  explicit TraceScope(Program& p) : previous_(current_slot()) { current_slot() = &p; }
  ~TraceScope() { current_slot() = previous_; }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

  static Program& current(const std::string& who) {
    if (!current_slot()) user_error(who + ": called outside partir::trace (no program is being traced)");
    return *current_slot();
  }

 private:
  static Program*& current_slot() {
    thread_local Program* current = nullptr;
    return current;
  }
  Program* previous_;
};

namespace detail {
// v cast to the active precision policy's compute dtype (v itself without a policy, or if v is not a float).
// One cast per value: every use of a parameter shares it, so its uses' gradients add up before the one
// reduction (and ZeRO-3 gathers one copy).
inline Tensor to_compute(Program& p, ValueId v) {
  const MixedPrecision* policy = PrecisionScope::active();
  if (!policy || !is_float(p.type(v).dtype) || p.type(v).dtype == policy->compute) return {p, v};
  for (ValueId u = v + 1; u < p.size(); ++u)
    if (const Op& op = p.op(u); op.kind == OpKind::convert && op.operands[0] == v && op.type.dtype == policy->compute)
      return {p, u};
  Attrs a;
  a.dtype = policy->compute;
  return {p, p.add(OpKind::convert, {v}, std::move(a))};
}
}  // namespace detail

// A data input of the traced program (a float one cast to the precision policy's compute dtype).
inline Tensor input(const std::string& name, Shape shape, DType dtype = DType::f32) {
  Program& p = TraceScope::current("input '" + name + "'");
  return detail::to_compute(p, p.add_input(name, {std::move(shape), dtype}, InputKind::data));
}

// A parameter: declared on first use, shared by later uses of the same name (which must agree on the type).
// Under a precision policy a float parameter is declared in its `params` dtype whatever `dtype` says, and
// each use is a cast to its `compute` dtype.
inline Tensor param(const std::string& name, Shape shape, Init init, DType dtype = DType::f32,
                    InputKind kind = InputKind::parameter) {
  Program& p = TraceScope::current("param '" + name + "'");
  const MixedPrecision* policy = PrecisionScope::active();
  const bool cast = policy && kind == InputKind::parameter && is_float(dtype);
  TensorType t{std::move(shape), cast ? policy->params : dtype};
  if (auto v = p.find_input(name)) {
    if (p.type(*v) != t)
      user_error("param '" + name + "': declared as " + to_string(p.type(*v)) + ", used again as " + to_string(t));
    return cast ? detail::to_compute(p, *v) : Tensor{p, *v};
  }
  const ValueId v = p.add_input(name, std::move(t), kind, init);
  return cast ? detail::to_compute(p, v) : Tensor{p, v};
}

inline Init normal_init(double stddev) { return {Init::Kind::normal, stddev}; }
inline Init uniform_init(double half_width) { return {Init::Kind::uniform, half_width}; }
inline Init zeros_init() { return {Init::Kind::zeros, 0}; }
inline Init ones_init() { return {Init::Kind::ones, 0}; }
inline Init constant_init(double value) { return {Init::Kind::constant, value}; }

// Names an intermediate so that tactics can select it by name.
inline Tensor tag(Tensor t, const std::string& name) {
  t.program().tag(t.id(), name);
  return t;
}
// Names a value for rematerialization policies (Remat's region boundaries); tactics never see it.
inline Tensor checkpoint_name(Tensor t, const std::string& name) {
  t.program().checkpoint_name(t.id(), name);
  return t;
}

}  // namespace partir
