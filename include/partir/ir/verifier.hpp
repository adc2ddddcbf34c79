#pragma once
// Checks a Program's invariants: operands defined before use, every stored type equal to the inferred one,
// unique input and output names, loop-carried outputs typed like the inputs they update. Programs built
// through Program::add are valid by construction; the verifier guards transforms and hand-built programs.
#include <set>

#include "partir/config.hpp"
#include "partir/ir/printer.hpp"

namespace partir {

// A UserError naming the first broken invariant, else nothing.
PARTIR_ENTRY void verify(const Program& p);

#if PARTIR_DEFINE_ENTRIES
PARTIR_ENTRY void verify(const Program& p) {
  std::set<std::string> input_names;
  for (ValueId v = 0; v < p.size(); ++v) {
    const Op& op = p.op(v);
    const std::string where = "verify " + p.name() + ": op %" + std::to_string(v) + " (" +
                              std::string(name_of(op.kind)) + ")";
    std::vector<TensorType> types;
    for (auto o : op.operands) {
      if (o < 0 || o >= v) user_error(where + " uses %" + std::to_string(o) + " before it is defined");
      types.push_back(p.type(o));
    }
    if (op.kind == OpKind::input && !input_names.insert(op.name).second)
      user_error(where + ": input name '" + op.name + "' is used twice");
    TensorType expected;
    try {
      expected = infer_type(op.kind, types, op.attrs);
    } catch (const UserError& e) {
      user_error(where + ": " + e.what());
    }
    if (expected != op.type)
      user_error(where + ": result type " + to_string(op.type) + " differs from the inferred " + to_string(expected));
  }
  std::set<std::string> output_names;
  for (const auto& o : p.outputs()) {
    if (o.value < 0 || o.value >= p.size()) user_error("verify " + p.name() + ": output '" + o.name + "' refers to undefined %" + std::to_string(o.value));
    if (!output_names.insert(o.name).second) user_error("verify " + p.name() + ": output name '" + o.name + "' is used twice");
    if (!o.updates.empty()) {
      auto in = p.find_input(o.updates);
      if (!in) user_error("verify " + p.name() + ": output '" + o.name + "' updates unknown input '" + o.updates + "'");
      if (p.type(*in) != p.type(o.value))
        user_error("verify " + p.name() + ": output '" + o.name + "' " + to_string(p.type(o.value)) +
                   " cannot update input '" + o.updates + "' " + to_string(p.type(*in)));
    }
  }
}
#endif

}  // namespace partir
