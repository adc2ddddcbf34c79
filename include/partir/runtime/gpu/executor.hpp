#pragma once
// Runs one device's share of an SpmdProgram on its GPU: the one walker (runtime/exec/executor.hpp) over the GPU
// Device below. The inputs are copied to device buffers from the caching pool, every op runs as a CUDA kernel
// or a cuBLAS call, every collective through NCCL, all in order on the communicator's stream; buffers go back
// to the pool by the plan's frees, and the outputs are copied back to host Arrays. Same inputs, outputs and options as the CPU executor (runtime/exec/executor.hpp),
// so `partir::execute(spmd, nccl_communicator, inputs)` picks this one.
//
// Link a program that includes this header with the kernels (one .cu file that includes
// gpu/kernels.cuh, compiled by nvcc), cuBLAS, NCCL and the CUDA runtime.
#include <cuda_runtime_api.h>

#include <chrono>
#include <map>
#include <memory>

#include "partir/runtime/exec/executable.hpp"
#include "partir/runtime/gpu/device_pool.hpp"
#include "partir/runtime/gpu/gemm.hpp"
#include "partir/runtime/gpu/launch.hpp"
#include "partir/runtime/gpu/views.hpp"
#include "partir/runtime/comm/nccl.hpp"

namespace partir::gpu {

// Per thread and GPU: the pool, the cuBLAS handle and the device flag that gather/scatter_add raise on an
// out-of-range index. Kept across runs so that steps after the first allocate nothing.
struct Context {
  DevicePool pool;
  cublasHandle_t blas = nullptr;
  int* bad_index = nullptr;
  const SpmdProgram* reserved_for = nullptr;  // the program whose liveness plan the pool was last sized by

  Context() {
    check_cublas(cublasCreate(&blas), "cublasCreate");
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&bad_index), sizeof(int)), "cudaMalloc");
  }
  ~Context() {  // at thread or process exit; the runtime may already be shutting down, so errors are ignored
    if (blas) cublasDestroy(blas);
    if (bad_index) cudaFree(bad_index);
  }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
};

inline Context& context(int gpu) {
  thread_local std::map<int, std::unique_ptr<Context>> contexts;
  auto& c = contexts[gpu];
  if (!c) c = std::make_unique<Context>();
  return *c;
}

// A value in device memory (a pool block), row-major.
struct Buffer {
  TensorType type_;
  void* data = nullptr;
  const TensorType& type() const { return type_; }
  std::int64_t bytes() const { return type_.bytes(); }
};

// The GPU Device of the walk (runtime/exec/executor.hpp: what a Device gives): values are pool blocks, every op
// a CUDA kernel or a cuBLAS call and every collective an NCCL call, all in order on the communicator's stream,
// so a block given back is only reused by work queued after it and needs no synchronization. Inputs are
// uploaded and outputs downloaded; spans are CUDA events, read once the run is synchronized. It runs unfused
// plans (every op by itself).
class Device {
 public:
  using Buffer = gpu::Buffer;
  struct Span {
    cudaEvent_t start = nullptr, stop = nullptr;
  };

  // `where` names the run in the errors found at its end.
  Device(nccl::Communicator& comm, Context& ctx, std::string where)
      : comm_(comm), ctx_(ctx), stream_(comm.stream()), where_(std::move(where)) {}

  Buffer take(const TensorType& type) { return {type, ctx_.pool.take(type.bytes())}; }
  void release(Buffer& b) {
    ctx_.pool.give(b.data, b.bytes());
    b.data = nullptr;
  }
  static Buffer take_storage(Buffer& from, const Shape& shape) {
    Buffer out{{shape, from.type().dtype}, from.data};
    from.data = nullptr;  // the husk: giving it back is a no-op
    return out;
  }
  const Buffer* bind(const Array& given, std::optional<Buffer>& slot) { return &slot.emplace(upload(given)); }
  Buffer adopt(Array&& a) { return upload(a); }
  Buffer copy(const Buffer& b) {
    Buffer out = take(b.type());
    copy_bytes(b, out);
    return out;
  }

  Buffer compute(const Op& op, const FusionGroup* group, std::span<const Buffer* const> values,
                 std::span<std::optional<Buffer>>, std::span<const ValueId>) {
    if (group) internal_error("gpu executor: a fused group at %" + std::to_string(group->root) + " in an unfused plan");
    operands_.clear();
    for (auto o : op.operands) operands_.push_back(values[static_cast<std::size_t>(o)]);
    return eval(op, operands_);
  }
  std::int64_t bind_side_outputs(const FusionGroup*, std::span<const Buffer*>, std::span<std::optional<Buffer>>) {
    return 0;
  }
  Buffer row_sharded(const SpmdOp& s, std::span<const Buffer* const> in, std::int64_t first_row, std::int64_t rows) {
    return eval(s.op, in, first_row, rows);
  }
  Buffer collective(const Collective& c, const Buffer& in, const TensorType& result, const Mesh& mesh,
                    nccl::Communicator& comm) {
    Buffer out = take(result);
    collective_into(c, in, out, mesh, comm);
    return out;
  }
  void collective_into(const Collective& c, const Buffer& in, Buffer& out, const Mesh& mesh, nccl::Communicator& comm) {
    const std::int64_t device = comm.device();
    const Group group = partir::detail::group_of(mesh, device, c.axes);
    const std::int64_t k = group.size();
    const DType t = in.type().dtype;
    const TensorType& result = out.type();
    switch (c.kind) {
      case CollectiveKind::all_slice: {
        gpu::copy(tile_view(in.type().shape, c.dim, k, mesh.position(device, c.axes)), in.data, out.data, t, stream_);
        return;
      }
      case CollectiveKind::all_reduce:  // in place when the walk handed over the operand's buffer
        if (out.data != in.data) copy_bytes(in, out);
        comm.all_reduce(group, out.data, result.elements(), t);
        return;
      case CollectiveKind::all_gather: {
        // Tiles of the leading dims are already contiguous blocks: gather straight into the result.
        if (tiles_are_blocks(result.shape, c.dim)) {
          comm.all_gather(group, in.data, out.data, in.type().elements(), t);
          return;
        }
        Buffer blocks = take(result);
        comm.all_gather(group, in.data, blocks.data, in.type().elements(), t);
        gpu::copy(tiles_view(result.shape, c.dim, k, false), blocks.data, out.data, t, stream_);
        release(blocks);
        return;
      }
      case CollectiveKind::reduce_scatter: {
        if (tiles_are_blocks(in.type().shape, c.dim)) {
          comm.reduce_scatter(group, in.data, out.data, result.elements(), t);
          return;
        }
        Buffer packed = take(in.type());
        gpu::copy(tiles_view(in.type().shape, c.dim, k, true), in.data, packed.data, t, stream_);
        comm.reduce_scatter(group, packed.data, out.data, result.elements(), t);
        release(packed);
        return;
      }
      case CollectiveKind::all_to_all: {
        Buffer sent = take(in.type()), received = take(in.type());
        gpu::copy(tiles_view(in.type().shape, c.to_dim, k, true), in.data, sent.data, t, stream_);
        comm.all_to_all(group, sent.data, received.data, in.type().elements() / k, t);
        gpu::copy(tiles_view(result.shape, c.dim, k, false), received.data, out.data, t, stream_);
        release(sent);
        release(received);
        return;
      }
      case CollectiveKind::collective_permute: {
        const auto [to, from] = partir::detail::permute_peers(c, mesh.position(device, c.axes), k);
        if (from < 0) check_cuda(cudaMemsetAsync(out.data, 0, static_cast<std::size_t>(result.bytes()), stream_), "cudaMemsetAsync");
        comm.collective_permute(group, to, in.data, from, out.data, in.type().elements(), t);
        return;
      }
      case CollectiveKind::send:
      case CollectiveKind::recv: break;  // execute() refuses pipelined programs
    }
    internal_error("gpu executor: " + std::string(name_of(c.kind)) + " is not run here");
  }

  Buffer transfer(const Collective& c, const Buffer*, const TensorType&, const Mesh&, nccl::Communicator&) {
    internal_error("gpu executor: " + std::string(name_of(c.kind)) + ": pipelined programs are refused before they run");
  }
  // Enqueues the copy to host and gives the block back; the array is valid after finish().
  Array download(Buffer&& b) {
    Array a = download(b);
    release(b);
    return a;
  }

  void begin() {
    check_cuda(cudaMemsetAsync(ctx_.bad_index, 0, sizeof(int), stream_), "cudaMemsetAsync");
    ops_ = start_span();
  }
  void ops_done() { stop_span(ops_); }
  // Waits for the stream; then the outputs are on the host and the spans can be read.
  void finish() {
    comm_.synchronize();
    int bad = 0;
    check_cuda(cudaMemcpy(&bad, ctx_.bad_index, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
    ops_seconds = span_times(ops_).seconds;
    if (bad)
      user_error(where_ + ": a gather or scatter_add index is out of range of its table (found on the GPU; run on "
                 "the CPU backend to see which index)");
  }
  // Blocks given back earlier in the run may still be in use by queued work: let it finish before the pool can
  // hand them to work on another stream (a later run on another communicator).
  void abandon() {
    cudaStreamSynchronize(stream_);
    cudaGetLastError();
  }
  Span start_span() {
    Span s;
    check_cuda(cudaEventCreate(&s.start), "cudaEventCreate");
    check_cuda(cudaEventCreate(&s.stop), "cudaEventCreate");
    check_cuda(cudaEventRecord(s.start, stream_), "cudaEventRecord");
    return s;
  }
  void stop_span(Span& s) { check_cuda(cudaEventRecord(s.stop, stream_), "cudaEventRecord"); }
  // After finish(): when the span started (from the start of the ops) and how long it took; frees its events.
  OpTiming span_times(Span& s) {
    float from_start = 0, took = 0;
    check_cuda(cudaEventElapsedTime(&took, s.start, s.stop), "cudaEventElapsedTime");
    if (s.start != ops_.start) {  // the ops' own span lives as long as the device
      check_cuda(cudaEventElapsedTime(&from_start, ops_.start, s.start), "cudaEventElapsedTime");
      cudaEventDestroy(s.start);
      cudaEventDestroy(s.stop);
    }
    return {-1, from_start / 1e3, took / 1e3};
  }
  ~Device() {
    if (ops_.start) cudaEventDestroy(ops_.start);
    if (ops_.stop) cudaEventDestroy(ops_.stop);
  }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  double ops_seconds = 0;  // the ops on the stream, from the first to the last, copies of inputs excluded

 private:
  void copy_bytes(const Buffer& from, Buffer& to) {
    if (from.bytes() > 0)
      check_cuda(cudaMemcpyAsync(to.data, from.data, static_cast<std::size_t>(from.bytes()), cudaMemcpyDeviceToDevice, stream_),
                 "cudaMemcpyAsync");
  }

  Buffer upload(const Array& a) {
    Buffer b = take(a.type());
    // From pageable memory the copy is staged before the call returns, so `a` may go away afterwards.
    if (a.bytes() > 0)
      check_cuda(cudaMemcpyAsync(b.data, layout::bytes(a), static_cast<std::size_t>(a.bytes()), cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync (upload)");
    return b;
  }

  // Enqueues the copy to host; valid after the stream is synchronized.
  Array download(const Buffer& b) {
    Array a(b.type());
    if (a.bytes() > 0)
      check_cuda(cudaMemcpyAsync(layout::bytes(a), b.data, static_cast<std::size_t>(a.bytes()), cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync (download)");
    return a;
  }

  // One local op; for a gather / scatter_add whose table rows are tiled, this device holds rows
  // [first_row, first_row + local rows) of global_rows (rows outside its block contribute zeros, indices
  // are checked against global_rows as on the CPU); global_rows < 0: not tiled.
  Buffer eval(const Op& op, std::span<const Buffer* const> in, std::int64_t first_row = 0, std::int64_t global_rows = -1) {
    using K = OpKind;
    Buffer out = take(op.type);
    const std::int64_t n = op.type.elements();
    const auto& a = op.attrs;
    auto float_only = [&](DType t) {
      if (t == DType::i32)
        user_error(std::string(name_of(op.kind)) + ": i32 operands are not supported, convert them to a float type first");
    };
    const Buffer* x = in.empty() ? nullptr : in[0];
    switch (op.kind) {
      case K::input: case K::count_:
        internal_error("gpu executor: no kernel for " + std::string(name_of(op.kind)));
      case K::constant:
        if (a.literal.size() == 1) {
          launch::fill(op.type.dtype, a.literal[0], out.data, n, stream_);
        } else {
          Array host(op.type);
          for (std::int64_t i = 0; i < n; ++i) host.set(i, a.literal[static_cast<std::size_t>(i)]);
          release(out);
          out = upload(host);
        }
        break;
      case K::neg: case K::exp: case K::log: case K::tanh: case K::rsqrt: case K::sqrt: case K::abs:
        float_only(x->type().dtype);
        launch::unary(op.kind, x->type().dtype, x->data, out.data, n, stream_);
        break;
      case K::add: case K::sub: case K::mul: case K::div: case K::max: case K::min: case K::pow:
        float_only(x->type().dtype);
        launch::binary(op.kind, x->type().dtype, x->data, in[1]->data, out.data, n, stream_);
        break;
      case K::add_n:  // left to right, as the adds it replaces
        float_only(x->type().dtype);
        check_cuda(cudaMemcpyAsync(out.data, x->data, static_cast<std::size_t>(op.type.bytes()), cudaMemcpyDeviceToDevice, stream_),
                   "cudaMemcpyAsync");
        for (std::size_t i = 1; i < in.size(); ++i)
          launch::binary(K::add, x->type().dtype, out.data, in[i]->data, out.data, n, stream_);
        break;
      case K::compare:
        launch::compare(a.cmp, x->type().dtype, x->data, in[1]->data, out.data, n, stream_);
        break;
      case K::select:
        launch::select(x->type().dtype, op.type.dtype, x->data, in[1]->data, in[2]->data, out.data, n, stream_);
        break;
      case K::convert:
        launch::convert(x->type().dtype, op.type.dtype, x->data, out.data, n, stream_);
        break;
      case K::dot_general:
        gpu::dot_general(ctx_.blas, x->type().shape, x->data, in[1]->type().shape, in[1]->data, a.dot, x->type().dtype, out.data,
                         ctx_.pool, stream_);
        break;
      case K::reduce_sum: case K::reduce_max: {
        const ReduceShape s = reduce_shape(x->type().shape, a.dims, op.kind);
        const std::int64_t parts = reduce_parts(s);
        // Scratch for the chunks of a split reduction (f32 sums for 16-bit inputs): given back once enqueued
        // (stream order, as dot_general's).
        const DType sums = is_half(x->type().dtype) ? DType::f32 : x->type().dtype;
        const std::int64_t scratch_bytes = parts > 1 ? s.outputs * parts * size_of(sums) : 0;
        void* scratch = parts > 1 ? ctx_.pool.take(scratch_bytes) : nullptr;
        launch::reduce(op.kind == K::reduce_max, x->type().dtype, s, x->data, out.data, scratch, stream_);
        ctx_.pool.give(scratch, scratch_bytes);
        break;
      }
      case K::broadcast_in_dim:
        gpu::copy(broadcast_view(x->type().shape, a), x->data, out.data, op.type.dtype, stream_);
        break;
      case K::reshape:
        if (n > 0)
          check_cuda(cudaMemcpyAsync(out.data, x->data, static_cast<std::size_t>(op.type.bytes()), cudaMemcpyDeviceToDevice, stream_),
                     "cudaMemcpyAsync");
        break;
      case K::transpose:
        gpu::copy(transpose_view(x->type().shape, a, op.type.shape), x->data, out.data, op.type.dtype, stream_);
        break;
      case K::slice:
        gpu::copy(slice_view(x->type().shape, a, op.type.shape), x->data, out.data, op.type.dtype, stream_);
        break;
      case K::pad:
        check_cuda(cudaMemsetAsync(out.data, 0, static_cast<std::size_t>(op.type.bytes()), stream_), "cudaMemsetAsync");
        gpu::copy(pad_view(x->type().shape, a, op.type.shape), x->data, out.data, op.type.dtype, stream_);
        break;
      case K::concatenate: {
        std::int64_t at = 0;
        for (const Buffer* part : in) {
          gpu::copy(concatenate_view(part->type().shape, a.axis, at, op.type.shape), part->data, out.data, op.type.dtype, stream_);
          at += part->type().shape[static_cast<std::size_t>(a.axis)];
        }
        break;
      }
      case K::convolution: {
        const Shape& w = in[1]->type().shape;
        launch::convolution(op.type.dtype, kernels::convolution_shape(x->type().shape, w, op.type.shape, a), x->type().shape.front(),
                            x->type().shape.back(), w.back(), a.conv.feature_groups, x->data, in[1]->data, out.data, stream_);
        break;
      }
      case K::reduce_window_sum: case K::reduce_window_max:
        launch::reduce_window(op.kind == K::reduce_window_max, op.type.dtype,
                              kernels::window_shape(op.kind, x->type().shape, a.window.window, op.type.shape, a), x->data, out.data, stream_);
        break;
      case K::select_and_scatter:  // x, g (one value per window) -> x's shape
        check_cuda(cudaMemsetAsync(out.data, 0, static_cast<std::size_t>(op.type.bytes()), stream_), "cudaMemsetAsync");
        launch::select_and_scatter(op.type.dtype, kernels::window_shape(op.kind, x->type().shape, a.window.window, in[1]->type().shape, a),
                                   x->data, in[1]->data, out.data, stream_);
        break;
      case K::gather: {  // table [V, F...], indices [I...] -> [I..., F...]
        const std::int64_t rows = x->type().shape.at(0), row = rows ? x->type().elements() / rows : 0;
        launch::gather(op.type.dtype, x->data, static_cast<const std::int32_t*>(in[1]->data), out.data,
                       in[1]->type().elements(), rows, row, global_rows < 0 ? 0 : first_row,
                       global_rows < 0 ? rows : global_rows, ctx_.bad_index, stream_);
        break;
      }
      case K::scatter_add: {  // indices [I...], updates [I..., F...] -> [V, F...]
        check_cuda(cudaMemsetAsync(out.data, 0, static_cast<std::size_t>(op.type.bytes()), stream_), "cudaMemsetAsync");
        const std::int64_t rows = op.type.shape.at(0), row = rows ? n / rows : 0;
        launch::scatter_add(op.type.dtype, static_cast<const std::int32_t*>(x->data), in[1]->data, out.data,
                            x->type().elements(), rows, row, global_rows < 0 ? 0 : first_row,
                            global_rows < 0 ? rows : global_rows, ctx_.bad_index, stream_);
        break;
      }
    }
    return out;
  }

 private:
  nccl::Communicator& comm_;
  Context& ctx_;
  cudaStream_t stream_;
  std::string where_;
  Span ops_;
  std::vector<const Buffer*> operands_;
};

// Runs an unfused plan (PlanOptions::fuse false: the GPU runs every op by itself) through the one walker.
inline DeviceResult execute(const ExecutionPlan& plan, nccl::Communicator& comm, const NamedArrays& inputs,
                            const ExecuteOptions& options = {}) {
  const SpmdProgram& p = plan.program();
  const std::string where = "execute " + p.name() + " (gpu, device " + std::to_string(comm.device()) + ")";
  if (p.pipeline())
    user_error(where + ": the program is pipelined over '" + p.pipeline()->axis +
               "', which the GPU executor does not run yet (its sends would serialize the stages on one stream); "
               "run pipelined programs on the threads or mpi backend");
  if (plan.options().fuse)
    user_error(where + ": the plan fuses elementwise groups, which the GPU executor runs op by op: make it with "
               "PlanOptions{.fuse = false}");
  partir::detail::check_run(p, comm.num_devices(), inputs, where);
  const StagePlan& stage = plan.stages().front();
  check_cuda(cudaSetDevice(comm.gpu()), "cudaSetDevice");
  Context& ctx = context(comm.gpu());
  if (ctx.reserved_for != &p) {  // first run of this program here: size the pool by its plan
    ctx.pool.reserve(plan_pool(stage).blocks);
    ctx.reserved_for = &p;
  }
  Device device(comm, ctx, where);
  DeviceResult r = partir::detail::Walk<Device, nccl::Communicator>(stage, device, comm, options, where).run(inputs);
  r.gpu_seconds = device.ops_seconds;
  return r;
}

// One run of p: the unfused plan made for it (donating state when options.donate is given).
inline DeviceResult execute(const SpmdProgram& p, nccl::Communicator& comm, const NamedArrays& inputs,
                            const ExecuteOptions& options = {}) {
  return execute(ExecutionPlan::borrowing(p, {.donate_state = options.donate != nullptr, .fuse = false}), comm, inputs,
                 options);
}

}  // namespace partir::gpu

namespace partir {

// The NCCL backend runs programs on its GPU: preferred by overload resolution over the CPU executor's
// templates for any Communicator.
inline DeviceResult execute(const ExecutionPlan& plan, nccl::Communicator& comm, const NamedArrays& inputs,
                            const ExecuteOptions& options = {}) {
  return gpu::execute(plan, comm, inputs, options);
}
inline DeviceResult execute(const SpmdProgram& p, nccl::Communicator& comm, const NamedArrays& inputs,
                            const ExecuteOptions& options = {}) {
  return gpu::execute(p, comm, inputs, options);
}

template <>
inline constexpr bool runs_fused_groups<nccl::Communicator> = false;

}  // namespace partir
