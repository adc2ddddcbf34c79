#pragma once
// partir::json::Value, declared only (nlohmann's json_fwd.hpp): enough for a header to declare functions that
// take or return JSON without parsing the JSON library. Code that builds, reads or writes JSON includes
// partir/sim/json.hpp.
#include <nlohmann/json_fwd.hpp>

namespace partir::json {

using Value = nlohmann::ordered_json;

}  // namespace partir::json
