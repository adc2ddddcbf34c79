#include <doctest/doctest.h>

#include <partir/partir.hpp>

using namespace partir;

TEST_CASE("ir: builder infers dot_general type") {
  Program p("t");
  auto x = p.add_input("x", {{8, 4}});
  auto w = p.add_input("w", {{4, 16}}, InputKind::parameter);
  Attrs a;
  a.dot.lhs_contract = {1};
  a.dot.rhs_contract = {0};
  auto y = p.add(OpKind::dot_general, {x, w}, a);
  CHECK(p.type(y) == TensorType{{8, 16}, DType::f32});
  p.add_output("y", y);
  verify(p);
}
