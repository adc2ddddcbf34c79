#pragma once
// Model weights in safetensors, the format Hugging Face, PyTorch and JAX users exchange: an 8-byte little-endian
// header length, a JSON header {name: {"dtype", "shape", "data_offsets": [begin, end)}} (offsets from the end of
// the header), then the raw little-endian data. A model past `max_file_bytes` is split into
// model-0000i-of-0000n.safetensors files listed by model.safetensors.index.json ({"weight_map": {name: file}}),
// as transformers' save_pretrained does; else DIR/model.safetensors.
//
// What is saved: the parameters (optimizer state stays in partir's own checkpoints), each under its path after
// params/ with '.' for '/': params/model/layers/0/mlp/up_proj/weight is model.layers.0.mlp.up_proj.weight, so
// nn::Llama's tensors carry Hugging Face's names.
//
// Under a plan nothing is gathered: device 0 writes the headers and sizes the files, then every device writes
// the pieces of the parameters it holds straight to their places in the files (of devices holding the same
// piece, the lowest writes it), and device 0 renames the finished files into place. restore reads each
// device's piece of each parameter, under the program's own layout, from the files mapped in memory: weights
// saved on any mesh (or by another framework) load onto any mesh and plan. Like checkpoints, the directory must
// be visible to every device.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "partir/runtime/comm/communicator.hpp"
#include "partir/runtime/kernels/elements.hpp"
#include "partir/runtime/kernels/layout.hpp"
#include "partir/runtime/state/state.hpp"
#include "partir/spmd/spmd_program.hpp"

namespace partir {

struct SafetensorsOptions {
  std::optional<DType> dtype = std::nullopt;          // convert float tensors to this (e.g. bf16); none: as held
  std::int64_t max_file_bytes = 5'000'000'000;        // transformers' default shard size ("5GB")
  friend bool operator==(const SafetensorsOptions&, const SafetensorsOptions&) = default;
};

namespace safetensors {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

inline const char* format_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
  }
  return "?";
}
inline std::optional<DType> parse_format(const std::string& name) {
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32})
    if (name == format_name(t)) return t;
  return std::nullopt;
}

// params/model/norm/weight <-> model.norm.weight.
inline std::string tensor_name(const std::string& parameter) {
  if (!parameter.starts_with("params/") || parameter.find('.') != std::string::npos)
    user_error("safetensors: parameter '" + parameter +
               "' is not named params/<path> without '.' (its tensor is named by the path, '.' for '/')");
  std::string out = parameter.substr(7);
  std::replace(out.begin(), out.end(), '/', '.');
  return out;
}
inline std::string parameter_name(const std::string& tensor) {
  std::string out = "params/" + tensor;
  std::replace(out.begin(), out.end(), '.', '/');
  return out;
}

// `n` elements of dtype `from` at `in` as dtype `to` at `out` (16-bit floats through f32, rounding to nearest
// even as Array::set does). Either side may be unaligned: a foreign file's offsets need not be.
inline void convert_elements(const std::byte* in, DType from, std::byte* out, DType to, std::int64_t n) {
  if (from == to) {
    std::memcpy(out, in, static_cast<std::size_t>(n * size_of(from)));
    return;
  }
  kernels::visit_dtype(from, [&]<class From>(From) {
    kernels::visit_dtype(to, [&]<class To>(To) {
      for (std::int64_t i = 0; i < n; ++i) {
        From x;
        std::memcpy(&x, in + i * static_cast<std::int64_t>(sizeof(From)), sizeof(From));
        To y;
        if constexpr (is_half_type<From> || is_half_type<To>) y = To(static_cast<float>(x));
        else y = static_cast<To>(x);
        std::memcpy(out + i * static_cast<std::int64_t>(sizeof(To)), &y, sizeof(To));
      }
    });
  });
}

// One tensor's place: its file and where its data starts there (bytes from the file's start).
struct Entry {
  std::string name, file;  // safetensors name; file name within the directory
  TensorType type;
  std::int64_t begin = 0;  // absolute offset in the file
};

// A directory's tensors as read from its headers, checked for form; every file mapped read-only.
class Reader {
 public:
  // `path`: a directory (model.safetensors, or the index and its files) or one .safetensors file.
  explicit Reader(const std::string& path) : dir_(path) {
    std::vector<std::string> files;
    const auto index = path + "/model.safetensors.index.json";
    if (path.ends_with(".safetensors") && std::filesystem::is_regular_file(path)) {
      dir_ = std::filesystem::path(path).parent_path().string();
      if (dir_.empty()) dir_ = ".";
      files.push_back(std::filesystem::path(path).filename().string());
    } else if (std::filesystem::exists(index)) {
      std::ifstream in(index);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(in);
      } catch (const nlohmann::json::exception& e) {
        user_error("safetensors '" + index + "': not JSON (" + e.what() + ")");
      }
      if (!j.contains("weight_map") || !j["weight_map"].is_object())
        user_error("safetensors '" + index + "': no \"weight_map\" object");
      for (const auto& [name, file] : j["weight_map"].items()) {
        if (!file.is_string()) user_error("safetensors '" + index + "': tensor '" + name + "' maps to a non-string");
        if (std::find(files.begin(), files.end(), file.get<std::string>()) == files.end()) files.push_back(file.get<std::string>());
        indexed_[name] = file.get<std::string>();
      }
    } else if (std::filesystem::exists(path + "/model.safetensors")) {
      files.push_back("model.safetensors");
    } else {
      user_error("safetensors '" + path + "': neither a .safetensors file nor a directory with model.safetensors or "
                 "model.safetensors.index.json");
    }
    for (const auto& f : files) open(f);
    for (const auto& [name, file] : indexed_)
      if (!entries_.contains(name))
        user_error("safetensors '" + path + "': the index maps tensor '" + name + "' to " + file + ", which does not hold it");
  }

  const std::map<std::string, Entry>& entries() const { return entries_; }

  // The piece of `e` of shape `piece` at `offset`, in dtype `dtype`.
  Array read(const Entry& e, const Shape& piece, const std::vector<std::int64_t>& offset, DType dtype) const {
    Array out(TensorType{piece, dtype});
    const std::byte* data = maps_.at(e.file).data + e.begin;
    const auto from = static_cast<std::int64_t>(size_of(e.type.dtype)), to = static_cast<std::int64_t>(size_of(dtype));
    layout::for_each_run(piece, e.type.shape, offset, [&](std::int64_t local, std::int64_t global, std::int64_t n) {
      convert_elements(data + global * from, e.type.dtype, layout::bytes(out) + local * to, dtype, n);
    });
    return out;
  }

 private:
  // A file mapped read-only, unmapped with its Reader (also when a later file's error ends the constructor).
  struct Mapped {
    const std::byte* data = nullptr;
    std::size_t size = 0;
    Mapped() = default;
    Mapped(const Mapped&) = delete;
    Mapped& operator=(const Mapped&) = delete;
    ~Mapped() {
      if (data) ::munmap(const_cast<std::byte*>(data), size);
    }
  };

  void open(const std::string& file) {
    const std::string path = dir_ + "/" + file;
    auto fail = [&](const std::string& why) { user_error("safetensors '" + path + "': " + why); };
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) fail("cannot open it (a file the index lists is missing?)");
    struct stat st {};
    ::fstat(fd, &st);
    const auto size = static_cast<std::size_t>(st.st_size);
    Mapped& m = maps_[file];
    if (size > 0) {
      void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        fail("cannot map it");
      }
      m.data = static_cast<const std::byte*>(p);
      m.size = size;
    }
    ::close(fd);
    if (size < 8) fail("truncated: " + std::to_string(size) + " bytes, not even the 8-byte header length");
    std::uint64_t header = 0;
    std::memcpy(&header, m.data, 8);
    if (header > size - 8)
      fail("truncated: the header is " + std::to_string(header) + " bytes, the file holds " + std::to_string(size - 8) +
           " after the length");
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(reinterpret_cast<const char*>(m.data) + 8, reinterpret_cast<const char*>(m.data) + 8 + header);
    } catch (const nlohmann::json::exception& e) {
      fail(std::string("the header is not JSON (") + e.what() + ")");
    }
    if (!j.is_object()) fail("the header is not a JSON object");
    const std::int64_t data_start = 8 + static_cast<std::int64_t>(header), data_size = static_cast<std::int64_t>(size) - data_start;
    std::vector<std::pair<std::pair<std::int64_t, std::int64_t>, std::string>> spans;
    for (const auto& [name, t] : j.items()) {
      if (name == "__metadata__") continue;
      auto bad = [&](const std::string& why) { fail("tensor '" + name + "': " + why); };
      if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets"))
        bad("needs \"dtype\", \"shape\" and \"data_offsets\"");
      if (!t["dtype"].is_string()) bad("\"dtype\" is not a string");
      const auto dtype = parse_format(t["dtype"].get<std::string>());
      if (!dtype)
        bad("unknown dtype '" + t["dtype"].get<std::string>() + "' (partir reads F32, BF16, F16, F64, I32)");
      Shape shape;
      if (!t["shape"].is_array()) bad("\"shape\" is not an array");
      for (const auto& d : t["shape"]) {
        if (!d.is_number_integer() || d.get<std::int64_t>() < 0) bad("\"shape\" " + t["shape"].dump() + " is not of sizes >= 0");
        shape.push_back(d.get<std::int64_t>());
      }
      const auto& o = t["data_offsets"];
      if (!o.is_array() || o.size() != 2 || !o[0].is_number_integer() || !o[1].is_number_integer())
        bad("\"data_offsets\" is not [begin, end]");
      const auto begin = o[0].get<std::int64_t>(), end = o[1].get<std::int64_t>();
      const TensorType type{shape, *dtype};
      if (begin < 0 || end - begin != type.bytes())
        bad("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + ") span " + std::to_string(end - begin) +
            " bytes, " + to_string(type) + " needs " + std::to_string(type.bytes()));
      if (end > data_size)
        bad("truncated: its data ends at byte " + std::to_string(end) + " of the data, the file holds " +
            std::to_string(data_size));
      if (entries_.contains(name)) bad("is in two files");
      if (auto it = indexed_.find(name); it != indexed_.end() && it->second != file)
        bad("is in " + file + ", the index says " + it->second);
      entries_[name] = {name, file, type, data_start + begin};
      spans.push_back({{begin, end}, name});
    }
    std::sort(spans.begin(), spans.end());
    for (std::size_t i = 1; i < spans.size(); ++i)
      if (spans[i].first.first < spans[i - 1].first.second)
        fail("tensors '" + spans[i - 1].second + "' and '" + spans[i].second + "' overlap (data_offsets [" +
             std::to_string(spans[i - 1].first.first) + ", " + std::to_string(spans[i - 1].first.second) + ") and [" +
             std::to_string(spans[i].first.first) + ", " + std::to_string(spans[i].first.second) + "))");
  }

  std::string dir_;
  std::map<std::string, std::string> indexed_;  // tensor -> file, from the index
  std::map<std::string, Mapped> maps_;
  std::map<std::string, Entry> entries_;
};

// The files of a save: tensors in order, packed into files of at most max_file_bytes of data (a larger tensor
// gets a file of its own); each file's header, padded with spaces to 8 bytes as the reference writer does.
struct Layout {
  struct File {
    std::string name, header;  // header: the 8-byte length and the JSON
    std::int64_t bytes = 0;    // the whole file
  };
  std::vector<File> files;
  std::vector<Entry> entries;
};

// `single`: the name of the file when one holds everything.
inline Layout plan_files(const std::vector<std::pair<std::string, TensorType>>& tensors, std::int64_t max_file_bytes,
                         const std::string& single = "model.safetensors") {
  std::vector<std::vector<std::size_t>> groups;
  std::int64_t filled = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::int64_t b = tensors[i].second.bytes();
    if (groups.empty() || (filled > 0 && filled + b > max_file_bytes)) {
      groups.emplace_back();
      filled = 0;
    }
    groups.back().push_back(i);
    filled += b;
  }
  Layout out;
  const std::size_t n = groups.size();
  for (std::size_t g = 0; g < n; ++g) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", g + 1, n);
    nlohmann::ordered_json header;
    header["__metadata__"] = {{"format", "pt"}};
    std::int64_t at = 0;
    for (std::size_t i : groups[g]) {
      const auto& [tensor, type] = tensors[i];
      header[tensor] = {{"dtype", format_name(type.dtype)}, {"shape", type.shape}, {"data_offsets", {at, at + type.bytes()}}};
      at += type.bytes();
    }
    std::string json = header.dump();
    json.append((8 - json.size() % 8) % 8, ' ');
    const std::uint64_t length = json.size();
    std::string bytes(8, '\0');
    std::memcpy(bytes.data(), &length, 8);
    Layout::File file{n == 1 ? single : name, bytes + json, 0};
    const auto data_start = static_cast<std::int64_t>(file.header.size());
    for (std::size_t i : groups[g]) {
      out.entries.push_back({tensors[i].first, file.name, tensors[i].second, data_start + file.bytes});
      file.bytes += tensors[i].second.bytes();
    }
    file.bytes += data_start;
    out.files.push_back(std::move(file));
  }
  return out;
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out.flush()) user_error("safetensors: cannot write '" + path + "'");
}

// Device 0's part before the pieces: the directory, each file at its size with its header, under a .tmp name;
// and the removal of files of an earlier save that this one does not rewrite.
inline void create_files(const std::string& dir, const Layout& layout, bool one_file = false) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (!std::filesystem::is_directory(dir))
    user_error("safetensors: cannot create directory '" + dir + "'" + (ec ? ": " + ec.message() : ""));
  if (!one_file)
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
      if ((name.starts_with("model") && name.ends_with(".safetensors")) || name == "model.safetensors.index.json")
        std::filesystem::remove(entry.path(), ec);
    }
  for (const auto& f : layout.files) {
    const std::string tmp = dir + "/" + f.name + ".tmp";
    write_file(tmp, f.header);
    std::filesystem::resize_file(tmp, static_cast<std::uintmax_t>(f.bytes), ec);
    if (ec) user_error("safetensors: cannot size '" + tmp + "': " + ec.message());
  }
}

// Writes pieces of tensors into the .tmp files create_files made: each file opened once per writer, synced
// once at finish().
class PieceWriter {
 public:
  explicit PieceWriter(std::string dir) : dir_(std::move(dir)) {}
  PieceWriter(const PieceWriter&) = delete;
  PieceWriter& operator=(const PieceWriter&) = delete;
  ~PieceWriter() {
    for (const auto& [file, fd] : fds_) ::close(fd);
  }

  // The piece `a` at `offset` in entry e's tensor, converted to e's dtype; rows that follow each other in the
  // file go out in one write.
  void write(const Entry& e, const Array& a, const std::vector<std::int64_t>& offset) {
    const int fd = open(e);
    const std::int64_t from = static_cast<std::int64_t>(size_of(a.dtype())), to = static_cast<std::int64_t>(size_of(e.type.dtype));
    std::int64_t pending_at = -1, pending_n = 0;
    auto flush = [&] {
      if (pending_n > 0 && ::pwrite(fd, run_.data(), static_cast<std::size_t>(pending_n * to), e.begin + pending_at * to) !=
                               static_cast<ssize_t>(pending_n * to))
        user_error("safetensors: cannot write '" + e.name + "' to '" + dir_ + "/" + e.file + ".tmp'");
      pending_n = 0;
    };
    layout::for_each_run(a.shape(), e.type.shape, offset, [&](std::int64_t local, std::int64_t global, std::int64_t n) {
      if (pending_n > 0 && pending_at + pending_n != global) flush();
      if (pending_n == 0) pending_at = global;
      run_.resize(static_cast<std::size_t>((pending_n + n) * to));
      convert_elements(layout::bytes(a) + local * from, a.dtype(), run_.data() + pending_n * to, e.type.dtype, n);
      pending_n += n;
    });
    flush();
  }

  void finish() {
    for (auto it = fds_.begin(); it != fds_.end(); it = fds_.erase(it)) {
      const bool synced = ::fsync(it->second) == 0;
      ::close(it->second);
      if (!synced) user_error("safetensors: cannot sync '" + dir_ + "/" + it->first + ".tmp'");
    }
  }

 private:
  int open(const Entry& e) {
    if (auto it = fds_.find(e.file); it != fds_.end()) return it->second;
    const std::string path = dir_ + "/" + e.file + ".tmp";
    const int fd = ::open(path.c_str(), O_WRONLY);
    if (fd < 0) user_error("safetensors: cannot open '" + path + "' to write '" + e.name + "'");
    return fds_[e.file] = fd;
  }

  std::string dir_;
  std::map<std::string, int> fds_;
  std::vector<std::byte> run_;
};

// Device 0's part after the pieces: the files into place (and the index when there are several).
inline void commit_files(const std::string& dir, const Layout& layout) {
  for (const auto& f : layout.files)
    if (std::rename((dir + "/" + f.name + ".tmp").c_str(), (dir + "/" + f.name).c_str()) != 0)
      user_error("safetensors: cannot rename '" + dir + "/" + f.name + ".tmp'");
  if (layout.files.size() < 2) return;
  nlohmann::ordered_json index;
  std::int64_t total = 0;
  for (const auto& e : layout.entries) {
    index["weight_map"][e.name] = e.file;
    total += e.type.bytes();
  }
  index["metadata"] = {{"total_size", total}};
  write_file(dir + "/model.safetensors.index.json", index.dump(2) + "\n");
}

inline TensorType saved_type(const TensorType& t, const SafetensorsOptions& o) {
  return {t.shape, o.dtype && is_float(t.dtype) ? *o.dtype : t.dtype};
}

}  // namespace safetensors

namespace safetensors {
// Whole tensors under their own names into `path` from one process: a directory (split past max_file_bytes),
// or one file if `path` ends in .safetensors.
inline void write(const std::string& path, const NamedArrays& tensors, const SafetensorsOptions& options = {}) {
  const bool one_file = path.ends_with(".safetensors");
  std::string dir = one_file ? std::filesystem::path(path).parent_path().string() : path;
  if (dir.empty()) dir = ".";
  std::vector<std::pair<std::string, TensorType>> types;
  for (const auto& [name, a] : tensors) types.emplace_back(name, saved_type(a.type(), options));
  const Layout layout = plan_files(types, one_file ? std::numeric_limits<std::int64_t>::max() : options.max_file_bytes,
                                   one_file ? std::filesystem::path(path).filename().string() : "model.safetensors");
  create_files(dir, layout, one_file);
  PieceWriter writer(dir);
  std::size_t i = 0;
  for (const auto& [name, a] : tensors) writer.write(layout.entries[i++], a, std::vector<std::int64_t>(a.shape().size(), 0));
  writer.finish();
  commit_files(dir, layout);
}
// Every tensor of `path` (a directory or a .safetensors file), whole, under its own name, as saved.
inline NamedArrays read(const std::string& path) {
  const Reader reader(path);
  NamedArrays out;
  for (const auto& [name, e] : reader.entries())
    out.emplace(name, reader.read(e, e.type.shape, std::vector<std::int64_t>(e.type.shape.size(), 0), e.type.dtype));
  return out;
}
}  // namespace safetensors

// Whole parameters (params/...) into DIR from one process, each as the tensor its path names.
inline void save_safetensors(const std::string& dir, const NamedArrays& parameters, const SafetensorsOptions& options = {}) {
  NamedArrays tensors;
  for (const auto& [name, a] : parameters) tensors.emplace(safetensors::tensor_name(name), a);
  safetensors::write(dir, tensors, options);
}

// Every tensor of DIR (or of one .safetensors file), whole, under its parameter name (params/...), as saved.
inline NamedArrays load_safetensors(const std::string& path) {
  NamedArrays out;
  for (auto& [name, a] : safetensors::read(path)) out.emplace(safetensors::parameter_name(name), std::move(a));
  return out;
}

// The parameters of `state` (this device's pieces, as `spmd` lays them out) into DIR. Collective: every device
// of the communicator calls it; each writes the pieces it is the first to hold.
template <Communicator C>
void save_safetensors(const std::string& dir, const SpmdProgram& spmd, C& comm, const NamedArrays& state,
                      const SafetensorsOptions& options = {}) {
  std::vector<const Binding*> parameters;
  std::vector<std::pair<std::string, TensorType>> tensors;
  for (const auto& b : spmd.inputs())
    if (spmd.op(b.value).op.attrs.input_kind == InputKind::parameter) {
      parameters.push_back(&b);
      tensors.emplace_back(safetensors::tensor_name(b.name), safetensors::saved_type(b.global, options));
    }
  const safetensors::Layout layout = safetensors::plan_files(tensors, options.max_file_bytes);
  const std::int64_t me = comm.device();
  if (me == 0) safetensors::create_files(dir, layout);
  comm.barrier();
  safetensors::PieceWriter writer(dir);
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const Binding& b = *parameters[i];
    if (!holds_state(spmd, b, me)) continue;
    const auto offset = layout::piece_offset(b.global.shape, b.sharding, spmd.mesh(), me);
    bool first = true;
    for (std::int64_t d = 0; d < me && first; ++d)
      first = !(holds_state(spmd, b, d) && layout::piece_offset(b.global.shape, b.sharding, spmd.mesh(), d) == offset);
    if (!first) continue;
    const auto it = state.find(b.name);
    if (it == state.end()) user_error("save_safetensors: the state has no '" + b.name + "'");
    writer.write(layout.entries[i], it->second, offset);
  }
  writer.finish();
  comm.barrier();
  if (me == 0) safetensors::commit_files(dir, layout);
  comm.barrier();  // no device reads DIR before it is complete
}

// Reads this device's piece of every parameter of `spmd` from DIR into `state`, converted to the program's
// dtypes: any mesh and plan, weights saved by partir or another framework. A tensor missing, of another shape,
// or not a parameter of the program is a UserError naming it. Optimizer state in `state` is left as it is.
template <Communicator C>
void restore_safetensors(const std::string& dir, const SpmdProgram& spmd, C& comm, NamedArrays& state) {
  const safetensors::Reader reader(dir);
  std::map<std::string, const Binding*> parameters;
  for (const auto& b : spmd.inputs())
    if (spmd.op(b.value).op.attrs.input_kind == InputKind::parameter) parameters[safetensors::tensor_name(b.name)] = &b;
  const std::string what = "safetensors '" + dir + "'";
  for (const auto& [name, e] : reader.entries())
    if (!parameters.contains(name))
      user_error(what + ": tensor '" + name + "' (" + e.file + ") is not a parameter of program '" + spmd.name() +
                 "' (no " + safetensors::parameter_name(name) + ")");
  for (const auto& [name, b] : parameters) {
    const auto it = reader.entries().find(name);
    if (it == reader.entries().end())
      user_error(what + " has no tensor '" + name + "' that program '" + spmd.name() + "' needs");
    const safetensors::Entry& e = it->second;
    if (e.type.shape != b->global.shape)
      user_error(what + ": tensor '" + name + "' is " + to_string(e.type) + ", program '" + spmd.name() + "' needs " +
                 to_string(b->global));
    if (is_float(e.type.dtype) != is_float(b->global.dtype))
      user_error(what + ": tensor '" + name + "' is " + to_string(e.type) + ", program '" + spmd.name() + "' needs " +
                 to_string(b->global) + " (floats and integers do not convert)");
    if (!holds_state(spmd, *b, comm.device())) continue;
    state[b->name] = reader.read(e, spmd.type(b->value).shape,
                                 layout::piece_offset(b->global.shape, b->sharding, spmd.mesh(), comm.device()),
                                 b->global.dtype);
  }
}

}  // namespace partir
