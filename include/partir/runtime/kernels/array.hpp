#pragma once
// Array: a dense, row-major, host-resident tensor value (what programs consume and produce at run time).
#include <cstring>
#include <map>
#include <new>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "partir/error.hpp"
#include "partir/ir/half.hpp"
#include "partir/ir/tensor_type.hpp"

namespace partir {

// Element storage that starts on a cache line: a kernel's 64-byte vector loads and stores then never straddle
// two lines (glibc's malloc aligns to 16 bytes, which made every AVX-512 access of a large array a split one).
// Below a page the plain allocator serves: glibc's aligned allocation costs more than small kernels gain.
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t line{64};
  static constexpr std::size_t aligned_from = 4096;  // bytes
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    return static_cast<T*>(bytes < aligned_from ? ::operator new(bytes) : ::operator new(bytes, line));
  }
  void deallocate(T* p, std::size_t n) {
    if (n * sizeof(T) < aligned_from) ::operator delete(p);
    else ::operator delete(p, line);
  }
  friend bool operator==(CacheLineAllocator, CacheLineAllocator) { return true; }
};
template <class T>
using Elements = std::vector<T, CacheLineAllocator<T>>;

class Array {
 public:
  using Storage =
      std::variant<Elements<float>, Elements<double>, Elements<std::int32_t>, Elements<bf16>, Elements<f16>>;

  Array() : Array(TensorType{{}, DType::f32}) {}
  explicit Array(TensorType type) : type_(std::move(type)) {
    for (auto d : type_.shape)
      if (d < 0) user_error("Array: negative dimension in shape " + to_string(type_.shape));
    switch (type_.dtype) {
      case DType::f32: data_ = Elements<float>(static_cast<std::size_t>(type_.elements())); break;
      case DType::f64: data_ = Elements<double>(static_cast<std::size_t>(type_.elements())); break;
      case DType::i32: data_ = Elements<std::int32_t>(static_cast<std::size_t>(type_.elements())); break;
      case DType::bf16: data_ = Elements<bf16>(static_cast<std::size_t>(type_.elements())); break;
      case DType::f16: data_ = Elements<f16>(static_cast<std::size_t>(type_.elements())); break;
    }
  }
  template <class T>
  Array(Shape shape, Elements<T> values) : type_{std::move(shape), dtype_of<T>()}, data_(std::move(values)) {
    if (static_cast<std::int64_t>(std::get<Elements<T>>(data_).size()) != type_.elements())
      user_error("Array: " + std::to_string(std::get<Elements<T>>(data_).size()) + " values for shape " +
                 to_string(type_.shape));
  }
  template <class T>
  Array(Shape shape, const std::vector<T>& values)
      : Array(std::move(shape), Elements<T>(values.begin(), values.end())) {}

  template <class T>
  static constexpr DType dtype_of() {
    if constexpr (std::is_same_v<T, float>) return DType::f32;
    else if constexpr (std::is_same_v<T, double>) return DType::f64;
    else if constexpr (std::is_same_v<T, bf16>) return DType::bf16;
    else if constexpr (std::is_same_v<T, f16>) return DType::f16;
    else return DType::i32;
  }

  const TensorType& type() const { return type_; }
  const Shape& shape() const { return type_.shape; }
  DType dtype() const { return type_.dtype; }
  std::int64_t size() const { return type_.elements(); }
  std::int64_t bytes() const { return type_.bytes(); }

  template <class T>
  std::span<T> data() { return std::get<Elements<T>>(data_); }
  template <class T>
  std::span<const T> data() const { return std::get<Elements<T>>(data_); }
  const Storage& storage() const { return data_; }
  Storage& storage() { return data_; }
  // Its storage was moved on (a buffer another array took over): it holds fewer elements than its type says.
  bool is_husk() const {
    return std::visit([&](const auto& v) { return static_cast<std::int64_t>(v.size()) != size(); }, data_);
  }

  // Element i (row-major) as double, and set from double (a 16-bit float rounds from x as an f32): for tests,
  // printing and initialization.
  double at(std::int64_t i) const {
    return std::visit([i](const auto& v) {
      using T = typename std::decay_t<decltype(v)>::value_type;
      if constexpr (is_half_type<T>) return static_cast<double>(static_cast<float>(v[static_cast<std::size_t>(i)]));
      else return static_cast<double>(v[static_cast<std::size_t>(i)]);
    }, data_);
  }
  void set(std::int64_t i, double x) {
    std::visit([i, x](auto& v) {
      using T = typename std::decay_t<decltype(v)>::value_type;
      if constexpr (is_half_type<T>) v[static_cast<std::size_t>(i)] = T(static_cast<float>(x));
      else v[static_cast<std::size_t>(i)] = static_cast<T>(x);
    }, data_);
  }

  friend bool operator==(const Array&, const Array&) = default;

 private:
  TensorType type_;
  Storage data_;
};

using NamedArrays = std::map<std::string, Array>;

}  // namespace partir
