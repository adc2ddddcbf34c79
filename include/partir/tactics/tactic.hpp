#pragma once
// Tactic: one step of a partitioning strategy, a value with a name (quoted in provenance and errors) and
// `apply(PartitionState&)`, which seeds decisions; partition() propagates them. Any type with those two
// members and operator== is a tactic (ManualPartition, Replicate, the presets, automatic search), held by
// value in a type-erased Tactic. A Schedule is an ordered list of tactics: order is priority.
#include <concepts>
#include <memory>

#include "partir/sharding/propagate.hpp"

namespace partir {

// equality_comparable comes last: checked first, it would recurse through Tactic's own operator==.
template <class T>
concept TacticLike = requires(const T& t, PartitionState& s) {
  { t.name() } -> std::convertible_to<std::string>;
  t.apply(s);
} && std::equality_comparable<T>;

class Tactic {
 public:
  template <TacticLike T>
    requires(!std::same_as<T, Tactic>)
  Tactic(T tactic) : self_(std::make_shared<const Model<T>>(std::move(tactic))) {}  // implicit: a Schedule lists tactics of any kind

  std::string name() const { return self_->name(); }
  void apply(PartitionState& state) const { self_->apply(state); }
  // The concrete tactic, or nullptr if it is not a T.
  template <class T>
  const T* as() const {
    auto* m = dynamic_cast<const Model<T>*>(self_.get());
    return m ? &m->value : nullptr;
  }

  friend bool operator==(const Tactic& a, const Tactic& b) { return a.self_->equals(*b.self_); }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual std::string name() const = 0;
    virtual void apply(PartitionState&) const = 0;
    virtual bool equals(const Concept&) const = 0;
  };
  template <class T>
  struct Model final : Concept {
    explicit Model(T t) : value(std::move(t)) {}
    std::string name() const override { return value.name(); }
    void apply(PartitionState& s) const override { value.apply(s); }
    bool equals(const Concept& other) const override {
      auto* o = dynamic_cast<const Model*>(&other);
      return o && o->value == value;
    }
    T value;
  };
  std::shared_ptr<const Concept> self_;
};

using Schedule = std::vector<Tactic>;

}  // namespace partir
