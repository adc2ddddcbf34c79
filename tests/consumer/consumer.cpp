#include <partir/partir.hpp>

#include <iostream>

int main() {
  namespace p = partir;
  p::Program prog = p::trace("consumer", [](p::Tensor x) { return p::sum(p::relu(x)); }, {{"x", {4}}});
  p::NamedArrays out = p::interpret(prog, {{"x", p::Array({4}, std::vector<float>{-1, 2, -3, 4})}});
  std::cout << out.at("out").at(0) << "\n";
  return out.at("out").at(0) == 6.0 ? 0 : 1;
}
