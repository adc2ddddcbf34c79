#pragma once
// The umbrella header: includes only.
#include "partir/error.hpp"
#include "partir/ir/dtype.hpp"
#include "partir/ir/tensor_type.hpp"
#include "partir/ir/op.hpp"
#include "partir/ir/shape_inference.hpp"
#include "partir/ir/program.hpp"
#include "partir/ir/printer.hpp"
#include "partir/ir/verifier.hpp"
#include "partir/runtime/array.hpp"
