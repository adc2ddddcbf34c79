#pragma once
// Two exception types: a UserError means the caller's program, tactic or input broke a rule and the
// message says which; an InternalError means partir itself is wrong (a bug to report).
#include <stdexcept>
#include <string>

namespace partir {

struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct InternalError : std::logic_error {
  using std::logic_error::logic_error;
};

[[noreturn]] inline void user_error(const std::string& message) { throw UserError(message); }
[[noreturn]] inline void internal_error(const std::string& message) {
  throw InternalError("partir internal error: " + message);
}

}  // namespace partir
