#pragma once
// Mesh: the devices as a grid of named axes, major to minor (row-major device ids, as in jax.sharding.Mesh).
// Mesh{{"batch", 2}, {"model", 2}}: device 1 sits at batch 0, model 1. The devices that differ only along
// some axes form one group of those axes: the participants of a collective over them.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "partir/error.hpp"

namespace partir {

struct MeshAxis {
  std::string name;
  std::int64_t size = 1;
  friend bool operator==(const MeshAxis&, const MeshAxis&) = default;
};

class Mesh {
 public:
  // Axis sets are bit masks in sharding code; more axes than this would not be a useful mesh anyway.
  static constexpr std::size_t max_axes = 32;

  Mesh() = default;
  Mesh(std::initializer_list<MeshAxis> axes) : Mesh(std::vector<MeshAxis>(axes)) {}
  explicit Mesh(std::vector<MeshAxis> axes) : axes_(std::move(axes)) {
    if (axes_.size() > max_axes) user_error("mesh " + to_string() + ": more than 32 axes");
    for (std::size_t i = 0; i < axes_.size(); ++i) {
      const auto& a = axes_[i];
      if (a.name.empty()) user_error("mesh " + to_string() + ": axis " + std::to_string(i) + " has an empty name");
      if (a.size < 1)
        user_error("mesh " + to_string() + ": axis '" + a.name + "' has size " + std::to_string(a.size) +
                   " (must be at least 1)");
      for (std::size_t j = 0; j < i; ++j)
        if (axes_[j].name == a.name) user_error("mesh " + to_string() + ": axis '" + a.name + "' appears twice");
    }
  }

  // "batch=2,model=2" (the examples' --mesh flag).
  static Mesh parse(std::string_view text) {
    std::vector<MeshAxis> axes;
    std::size_t start = 0;
    while (start <= text.size()) {
      const auto end = std::min(text.find(',', start), text.size());
      const auto item = text.substr(start, end - start);
      const auto eq = item.find('=');
      std::int64_t size = 0;
      bool ok = eq != std::string_view::npos && eq + 1 < item.size();
      for (std::size_t i = eq + 1; ok && i < item.size(); ++i) {
        ok = item[i] >= '0' && item[i] <= '9' && size < (std::int64_t{1} << 40);
        size = size * 10 + (item[i] - '0');
      }
      if (!ok)
        user_error("mesh '" + std::string(text) + "': expected axes as name=size separated by commas, got '" +
                   std::string(item) + "'");
      axes.push_back({std::string(item.substr(0, eq)), size});
      start = end + 1;
    }
    return Mesh(std::move(axes));
  }

  const std::vector<MeshAxis>& axes() const { return axes_; }
  std::int64_t rank() const { return static_cast<std::int64_t>(axes_.size()); }
  std::int64_t num_devices() const {
    std::int64_t n = 1;
    for (const auto& a : axes_) n *= a.size;
    return n;
  }

  // Index of the axis named `name`, -1 if the mesh has none.
  int find_axis(std::string_view name) const {
    for (std::size_t i = 0; i < axes_.size(); ++i)
      if (axes_[i].name == name) return static_cast<int>(i);
    return -1;
  }
  bool has_axis(std::string_view name) const { return find_axis(name) >= 0; }
  int axis_index(std::string_view name) const {
    const int i = find_axis(name);
    if (i < 0) user_error("axis '" + std::string(name) + "' is not in mesh " + to_string());
    return i;
  }
  std::int64_t axis_size(std::string_view name) const { return axes_[static_cast<std::size_t>(axis_index(name))].size; }

  // Coordinate of `device` along each axis.
  std::vector<std::int64_t> coordinates(std::int64_t device) const {
    check_device(device);
    std::vector<std::int64_t> c(axes_.size());
    for (auto i = axes_.size(); i-- > 0;) {
      c[i] = device % axes_[i].size;
      device /= axes_[i].size;
    }
    return c;
  }
  std::int64_t device_at(const std::vector<std::int64_t>& coords) const {
    if (coords.size() != axes_.size())
      user_error("mesh " + to_string() + ": " + std::to_string(coords.size()) + " coordinates for " +
                 std::to_string(axes_.size()) + " axes");
    std::int64_t d = 0;
    for (std::size_t i = 0; i < axes_.size(); ++i) {
      if (coords[i] < 0 || coords[i] >= axes_[i].size)
        user_error("mesh " + to_string() + ": coordinate " + std::to_string(coords[i]) + " is outside axis '" +
                   axes_[i].name + "'");
      d = d * axes_[i].size + coords[i];
    }
    return d;
  }

  // The position of `device` along `axes` taken in the given order, major to minor: which tile of a dim
  // tiled on exactly these axes the device holds.
  std::int64_t position(std::int64_t device, const std::vector<std::string>& axes) const {
    const auto c = coordinates(device);
    std::int64_t p = 0;
    for (const auto& name : axes) {
      const auto i = static_cast<std::size_t>(axis_index(name));
      p = p * axes_[i].size + c[i];
    }
    return p;
  }

  // The group of `device` along `axes`: the devices equal to it on every other axis, ordered by position().
  std::vector<std::int64_t> group(std::int64_t device, const std::vector<std::string>& axes) const {
    auto c = coordinates(device);
    std::vector<std::size_t> along;
    for (const auto& name : axes) {
      const auto i = static_cast<std::size_t>(axis_index(name));
      for (auto j : along)
        if (j == i) user_error("mesh group: axis '" + name + "' is named twice");
      along.push_back(i);
    }
    std::int64_t count = 1;
    for (auto i : along) count *= axes_[i].size;
    std::vector<std::int64_t> members;
    for (std::int64_t p = 0; p < count; ++p) {
      auto rest = p;
      for (auto k = along.size(); k-- > 0;) {
        c[along[k]] = rest % axes_[along[k]].size;
        rest /= axes_[along[k]].size;
      }
      members.push_back(device_at(c));
    }
    return members;
  }

  // All groups along `axes`, each ordered by position(), the groups ordered by their smallest device.
  std::vector<std::vector<std::int64_t>> groups(const std::vector<std::string>& axes) const {
    std::vector<std::vector<std::int64_t>> out;
    std::vector<bool> seen(static_cast<std::size_t>(num_devices()), false);
    for (std::int64_t d = 0; d < num_devices(); ++d) {
      if (seen[static_cast<std::size_t>(d)]) continue;
      out.push_back(group(d, axes));
      for (auto m : out.back()) seen[static_cast<std::size_t>(m)] = true;
    }
    return out;
  }

  // "{batch=2,model=2}"
  std::string to_string() const {
    std::string s = "{";
    for (std::size_t i = 0; i < axes_.size(); ++i)
      s += (i ? "," : "") + axes_[i].name + "=" + std::to_string(axes_[i].size);
    return s + "}";
  }

  friend bool operator==(const Mesh&, const Mesh&) = default;

 private:
  void check_device(std::int64_t device) const {
    if (device < 0 || device >= num_devices())
      user_error("mesh " + to_string() + ": device " + std::to_string(device) + " is out of range (" +
                 std::to_string(num_devices()) + " devices)");
  }

  std::vector<MeshAxis> axes_;
};

inline std::string to_string(const Mesh& m) { return m.to_string(); }

}  // namespace partir
