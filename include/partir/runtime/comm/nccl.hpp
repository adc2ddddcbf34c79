#pragma once
// The NCCL backend: one GPU per device. Every rank shares one world communicator (made from an
// ncclUniqueId: by nccl::run for threads of one process, by nccl::from_mpi in runtime/comm/nccl_mpi.hpp for MPI
// ranks); each group gets its own communicator from ncclCommSplit the first time it is used. As in the MPI
// backend, SPMD programs issue the same collectives in the same order on every device, so every device
// reaches the (collective) split of its own group together with the others.
//
// Buffers may live on the device or on the host:
//   device buffers: the collective is enqueued on stream() and the call returns, as NCCL's calls do; work
//                   enqueued later on stream() sees the result, synchronize() waits for it;
//   host buffers:   staged through device scratch memory; the result is in place when the call returns
//                   (what the examples' and benchmarks' bookkeeping on host values needs).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <exception>
#include <map>
#include <thread>

#include "partir/runtime/comm/communicator.hpp"
#include "partir/runtime/gpu/cuda_error.hpp"
#include "partir/runtime/gpu/device.hpp"

namespace partir::nccl {

inline void check(ncclResult_t r, const char* call, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess) return;
  std::string text = std::string("nccl backend: ") + call + " failed: " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last && *last) text += std::string(" (") + last + ")";
  if (r == ncclUnhandledCudaError) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) text += "; CUDA: " + gpu::cuda_error_text(e);
  }
  throw UserError(text);
}

inline ncclDataType_t datatype(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::i32: return ncclInt32;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
  }
  internal_error("nccl backend: unknown dtype");
}

inline ncclUniqueId unique_id() {
  ncclUniqueId id;
  check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return id;
}

class Communicator {
 public:
  // One process, one GPU: the only device of a 1-device mesh.
  Communicator() : Communicator(1, 0, first_id(), 0) {}

  // Device `rank` of `ranks`, all made with the same `id` (from unique_id() on one of them), on CUDA device
  // `gpu`. Blocks until every rank has joined.
  Communicator(int ranks, int rank, const ncclUniqueId& id, int gpu) : device_(rank), devices_(ranks), gpu_(gpu) {
    if (ranks < 1 || rank < 0 || rank >= ranks)
      user_error("nccl::Communicator: rank " + std::to_string(rank) + " is not in [0, " + std::to_string(ranks) + ")");
    const gpu::DeviceCount d = gpu::probe_devices();
    if (d.count == 0) user_error(gpu::no_device_message("nccl::Communicator"));
    if (gpu < 0 || gpu >= d.count)
      user_error("nccl::Communicator: CUDA device " + std::to_string(gpu) + " does not exist (" +
                 std::to_string(d.count) + " present)");
    gpu::check_cuda(cudaSetDevice(gpu), "cudaSetDevice");
    gpu::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check(ncclCommInitRank(&world_, ranks, id, rank), "ncclCommInitRank");
  }
  ~Communicator() {  // on whichever thread: make this communicator's GPU current first
    if (stream_) {
      cudaSetDevice(gpu_);
      cudaStreamSynchronize(stream_);
    }
    for (auto& [devices, c] : groups_) ncclCommDestroy(c);
    if (world_) ncclCommDestroy(world_);
    if (scratch_) cudaFree(scratch_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int device() const { return device_; }
  int num_devices() const { return devices_; }
  int gpu() const { return gpu_; }
  cudaStream_t stream() const { return stream_; }

  void all_reduce(const Group& g, void* data, std::int64_t n, DType t) {
    Staging s(*this, data, nullptr, n * size_of(t), 0, false);
    ncclComm_t c = comm(g);
    check(ncclAllReduce(s.in, s.in, count(n), datatype(t), ncclSum, c, stream_), "ncclAllReduce", c);
    s.finish(data, n * size_of(t), true);
  }
  void all_gather(const Group& g, const void* in, void* out, std::int64_t n, DType t) {
    Staging s(*this, in, out, n * size_of(t), n * g.size() * size_of(t));
    ncclComm_t c = comm(g);
    check(ncclAllGather(s.in, s.out, count(n), datatype(t), c, stream_), "ncclAllGather", c);
    s.finish(out, n * g.size() * size_of(t));
  }
  void reduce_scatter(const Group& g, const void* in, void* out, std::int64_t n, DType t) {
    Staging s(*this, in, out, n * g.size() * size_of(t), n * size_of(t));
    ncclComm_t c = comm(g);
    check(ncclReduceScatter(s.in, s.out, count(n), datatype(t), ncclSum, c, stream_), "ncclReduceScatter", c);
    s.finish(out, n * size_of(t));
  }
  // Point to point on the world communicator. NCCL pairs a send with the peer's receive in order (tags are
  // the executor's to keep consistent). Host buffers are staged and the call waits for completion, so a
  // pipelined step would serialize its stages: the GPU executor refuses pipelined programs until sends get a
  // stream of their own (runtime/gpu/executor.hpp).
  void send(int peer, const void* data, std::int64_t n, DType t, std::int64_t /*tag*/) {
    Staging s(*this, data, nullptr, n * size_of(t), 0, false);
    check(ncclSend(s.in, count(n), datatype(t), peer, world_, stream_), "ncclSend", world_);
    s.finish(nullptr, 0);
  }
  void recv(int peer, void* data, std::int64_t n, DType t, std::int64_t /*tag*/) {
    Staging s(*this, nullptr, data, 0, n * size_of(t));
    check(ncclRecv(s.out, count(n), datatype(t), peer, world_, stream_), "ncclRecv", world_);
    s.finish(data, n * size_of(t));
  }
  // NCCL has no all-to-all: one send and one receive per member, grouped so that NCCL runs them together.
  void all_to_all(const Group& g, const void* in, void* out, std::int64_t n, DType t) {
    const std::int64_t block = n * size_of(t);
    Staging s(*this, in, out, block * g.size(), block * g.size());
    ncclComm_t c = comm(g);
    check(ncclGroupStart(), "ncclGroupStart");
    // A failing send or receive must still close the group: an open group would swallow every later call.
    ncclResult_t r = ncclSuccess;
    const char* failed = "";
    for (int q = 0; q < g.size() && r == ncclSuccess; ++q) {
      r = ncclSend(static_cast<const std::byte*>(s.in) + q * block, count(n), datatype(t), q, c, stream_);
      failed = "ncclSend";
      if (r != ncclSuccess) break;
      r = ncclRecv(static_cast<std::byte*>(s.out) + q * block, count(n), datatype(t), q, c, stream_);
      failed = "ncclRecv";
    }
    const ncclResult_t end = ncclGroupEnd();
    check(r, failed, c);
    check(end, "ncclGroupEnd", c);
    s.finish(out, block * g.size());
  }
  // One send and one receive, grouped so that a chain of neighbours runs at once instead of one after another.
  void collective_permute(const Group& g, int to, const void* in, int from, void* out, std::int64_t n, DType t) {
    const std::int64_t bytes = n * size_of(t);
    Staging s(*this, in, out, to >= 0 ? bytes : 0, from >= 0 ? bytes : 0);
    ncclComm_t c = comm(g);
    check(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t r = ncclSuccess;  // the group is closed whatever happens (see all_to_all)
    const char* failed = "ncclSend";
    if (to >= 0) r = ncclSend(s.in, count(n), datatype(t), to, c, stream_);
    if (r == ncclSuccess && from >= 0) r = ncclRecv(s.out, count(n), datatype(t), from, c, stream_), failed = "ncclRecv";
    const ncclResult_t end = ncclGroupEnd();
    check(r, failed, c);
    check(end, "ncclGroupEnd", c);
    s.finish(out, from >= 0 ? bytes : 0);
  }
  // Every device's enqueued work done, then all devices together.
  void barrier() {
    synchronize();
    void* token = scratch(sizeof(float));
    check(ncclAllReduce(token, token, 1, ncclFloat32, ncclSum, world_, stream_), "ncclAllReduce (barrier)", world_);
    synchronize();
  }
  // Waits for everything enqueued on stream().
  void synchronize() { gpu::check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

 private:
  // Checks for a GPU before NCCL is touched, so a machine without one gets the no-device message.
  static ncclUniqueId first_id() {
    gpu::require_devices(1, "nccl::Communicator");
    return unique_id();
  }

  static std::size_t count(std::int64_t n) {
    if (n < 0) internal_error("nccl backend: negative element count " + std::to_string(n));
    return static_cast<std::size_t>(n);
  }

  static bool on_device(const void* p) {
    if (!p) return false;
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }

  // Device scratch of at least `bytes`, grown (never shrunk) as needed; only host-buffer calls and barrier
  // use it, and they synchronize before returning, so one buffer serves them all.
  void* scratch(std::int64_t bytes) {
    if (bytes > scratch_bytes_) {
      synchronize();
      if (scratch_) gpu::check_cuda(cudaFree(scratch_), "cudaFree");
      scratch_ = nullptr;
      gpu::check_cuda(cudaMalloc(&scratch_, static_cast<std::size_t>(bytes)), "cudaMalloc (nccl staging buffer)");
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }

  // Device pointers for one call: the caller's where they are device memory, else staged copies in
  // scratch (input first, output after it). finish() copies a staged output back and waits.
  struct Staging {
    Communicator& comm;
    void* in = nullptr;
    void* out = nullptr;
    bool staged = false;
    Staging(Communicator& c, const void* in_ptr, void* out_ptr, std::int64_t in_bytes, std::int64_t out_bytes,
            bool has_out = true)
        : comm(c) {
      gpu::check_cuda(cudaSetDevice(c.gpu_), "cudaSetDevice");
      const bool in_dev = on_device(in_ptr), out_dev = !has_out || on_device(out_ptr);
      staged = !in_dev || !out_dev;
      const std::int64_t in_room = (in_bytes + 255) / 256 * 256;
      std::byte* base = staged ? static_cast<std::byte*>(c.scratch(in_room + (has_out ? out_bytes : 0))) : nullptr;
      in = in_dev ? const_cast<void*>(in_ptr) : base;
      out = !has_out ? nullptr : out_dev ? out_ptr : base + in_room;
      if (!in_dev && in_bytes > 0)
        gpu::check_cuda(cudaMemcpyAsync(in, in_ptr, static_cast<std::size_t>(in_bytes), cudaMemcpyHostToDevice, c.stream_),
                        "cudaMemcpyAsync (stage input)");
    }
    // in_place: the result is in `in` (all_reduce), else in `out`.
    void finish(void* user_out, std::int64_t bytes, bool in_place = false) {
      if (!staged) return;
      void* result = in_place ? in : out;
      if (result != user_out && bytes > 0)
        gpu::check_cuda(cudaMemcpyAsync(user_out, result, static_cast<std::size_t>(bytes), cudaMemcpyDeviceToHost, comm.stream_),
                        "cudaMemcpyAsync (unstage output)");
      comm.synchronize();
    }
  };

  ncclComm_t comm(const Group& g) {
    if (g.size() == devices_) {
      bool world = true;
      for (int i = 0; i < devices_; ++i) world = world && g.devices[static_cast<std::size_t>(i)] == i;
      if (world) return world_;
    }
    auto it = groups_.find(g.devices);
    if (it != groups_.end()) return it->second;
    ncclComm_t c = nullptr;
    // color: the group's first device (unique per group); key: position in the group, which is the rank
    // all_to_all's sends and receives address.
    check(ncclCommSplit(world_, g.devices.front(), g.index_of(device_), &c, nullptr), "ncclCommSplit", world_);
    return groups_[g.devices] = c;
  }

  int device_ = 0, devices_ = 1, gpu_ = 0;
  cudaStream_t stream_ = nullptr;
  ncclComm_t world_ = nullptr;
  std::map<std::vector<int>, ncclComm_t> groups_;
  void* scratch_ = nullptr;
  std::int64_t scratch_bytes_ = 0;
};

// Runs fn(communicator) for `devices` devices as threads of this process, device d on CUDA device d (NCCL
// allows one rank per GPU). The first exception is rethrown after every thread has ended; a failure on one
// device can leave the others waiting inside NCCL, as with any NCCL program.
template <class Fn>
void run(int devices, Fn&& fn) {
  gpu::require_devices(devices, "nccl::run");
  const ncclUniqueId id = unique_id();
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(devices));
  std::vector<std::thread> threads;
  for (int d = 0; d < devices; ++d)
    threads.emplace_back([&, d] {
      try {
        Communicator c(devices, d, id, d);
        fn(c);
      } catch (...) {
        errors[static_cast<std::size_t>(d)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace partir::nccl
