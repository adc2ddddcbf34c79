#pragma once
// Runs one device's share of an SpmdProgram on its GPU: the inputs are copied to device buffers from the
// caching pool, every op runs as a CUDA kernel or a cuBLAS call, every collective through NCCL, all in
// order on the communicator's stream; buffers go back to the pool at their last use, and the outputs are
// copied back to host Arrays. Same inputs, outputs and options as the CPU executor (runtime/exec/executor.hpp),
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
  TensorType type;
  void* data = nullptr;
};

namespace detail {

class Runner {
 public:
  Runner(const SpmdProgram& p, nccl::Communicator& comm, Context& ctx)
      : mesh_(p.mesh()), comm_(comm), ctx_(ctx), stream_(comm.stream()) {}

  Buffer take(const TensorType& type) { return {type, ctx_.pool.take(type.bytes())}; }
  void give(Buffer& b) {
    ctx_.pool.give(b.data, b.type.bytes());
    b.data = nullptr;
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
    Array a(b.type);
    if (a.bytes() > 0)
      check_cuda(cudaMemcpyAsync(layout::bytes(a), b.data, static_cast<std::size_t>(a.bytes()), cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync (download)");
    return a;
  }

  Buffer collective(const Collective& c, const Buffer& in, const TensorType& result) {
    const std::int64_t device = comm_.device();
    const Group group = partir::detail::group_of(mesh_, device, c.axes);
    const std::int64_t k = group.size();
    const DType t = in.type.dtype;
    Buffer out = take(result);
    switch (c.kind) {
      case CollectiveKind::all_slice: {
        copy(tile_view(in.type.shape, c.dim, k, mesh_.position(device, c.axes)), in.data, out.data, t, stream_);
        return out;
      }
      case CollectiveKind::all_reduce:
        check_cuda(cudaMemcpyAsync(out.data, in.data, static_cast<std::size_t>(in.type.bytes()), cudaMemcpyDeviceToDevice, stream_),
                   "cudaMemcpyAsync");
        comm_.all_reduce(group, out.data, result.elements(), t);
        return out;
      case CollectiveKind::all_gather: {
        // Tiles of the leading dims are already contiguous blocks: gather straight into the result.
        if (tiles_are_blocks(result.shape, c.dim)) {
          comm_.all_gather(group, in.data, out.data, in.type.elements(), t);
          return out;
        }
        Buffer blocks = take(result);
        comm_.all_gather(group, in.data, blocks.data, in.type.elements(), t);
        copy(tiles_view(result.shape, c.dim, k, false), blocks.data, out.data, t, stream_);
        give(blocks);
        return out;
      }
      case CollectiveKind::reduce_scatter: {
        if (tiles_are_blocks(in.type.shape, c.dim)) {
          comm_.reduce_scatter(group, in.data, out.data, result.elements(), t);
          return out;
        }
        Buffer packed = take(in.type);
        copy(tiles_view(in.type.shape, c.dim, k, true), in.data, packed.data, t, stream_);
        comm_.reduce_scatter(group, packed.data, out.data, result.elements(), t);
        give(packed);
        return out;
      }
      case CollectiveKind::all_to_all: {
        Buffer sent = take(in.type), received = take(in.type);
        copy(tiles_view(in.type.shape, c.to_dim, k, true), in.data, sent.data, t, stream_);
        comm_.all_to_all(group, sent.data, received.data, in.type.elements() / k, t);
        copy(tiles_view(result.shape, c.dim, k, false), received.data, out.data, t, stream_);
        give(sent);
        give(received);
        return out;
      }
      case CollectiveKind::collective_permute: {
        const auto [to, from] = partir::detail::permute_peers(c, mesh_.position(device, c.axes), k);
        if (from < 0) check_cuda(cudaMemsetAsync(out.data, 0, static_cast<std::size_t>(result.bytes()), stream_), "cudaMemsetAsync");
        comm_.collective_permute(group, to, in.data, from, out.data, in.type.elements(), t);
        return out;
      }
      case CollectiveKind::send:
      case CollectiveKind::recv: break;  // execute() refuses pipelined programs
    }
    internal_error("gpu executor: unknown collective");
  }

  // One local op; for a gather / scatter_add whose table rows are tiled, this device holds rows
  // [first_row, first_row + local rows) of global_rows (rows outside its block contribute zeros, indices
  // are checked against global_rows as on the CPU); global_rows < 0: not tiled.
  Buffer eval(const Op& op, const std::vector<const Buffer*>& in, std::int64_t first_row = 0,
              std::int64_t global_rows = -1) {
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
          give(out);
          out = upload(host);
        }
        break;
      case K::neg: case K::exp: case K::log: case K::tanh: case K::rsqrt: case K::sqrt: case K::abs:
        float_only(x->type.dtype);
        launch::unary(op.kind, x->type.dtype, x->data, out.data, n, stream_);
        break;
      case K::add: case K::sub: case K::mul: case K::div: case K::max: case K::min: case K::pow:
        float_only(x->type.dtype);
        launch::binary(op.kind, x->type.dtype, x->data, in[1]->data, out.data, n, stream_);
        break;
      case K::add_n:  // left to right, as the adds it replaces
        float_only(x->type.dtype);
        check_cuda(cudaMemcpyAsync(out.data, x->data, static_cast<std::size_t>(op.type.bytes()), cudaMemcpyDeviceToDevice, stream_),
                   "cudaMemcpyAsync");
        for (std::size_t i = 1; i < in.size(); ++i)
          launch::binary(K::add, x->type.dtype, out.data, in[i]->data, out.data, n, stream_);
        break;
      case K::compare:
        launch::compare(a.cmp, x->type.dtype, x->data, in[1]->data, out.data, n, stream_);
        break;
      case K::select:
        launch::select(x->type.dtype, op.type.dtype, x->data, in[1]->data, in[2]->data, out.data, n, stream_);
        break;
      case K::convert:
        launch::convert(x->type.dtype, op.type.dtype, x->data, out.data, n, stream_);
        break;
      case K::dot_general:
        gpu::dot_general(ctx_.blas, x->type.shape, x->data, in[1]->type.shape, in[1]->data, a.dot, x->type.dtype, out.data,
                         ctx_.pool, stream_);
        break;
      case K::reduce_sum: case K::reduce_max: {
        const ReduceShape s = reduce_shape(x->type.shape, a.dims, op.kind);
        const std::int64_t parts = reduce_parts(s);
        // Scratch for the chunks of a split reduction (f32 sums for 16-bit inputs): given back once enqueued
        // (stream order, as dot_general's).
        const DType sums = is_half(x->type.dtype) ? DType::f32 : x->type.dtype;
        const std::int64_t scratch_bytes = parts > 1 ? s.outputs * parts * size_of(sums) : 0;
        void* scratch = parts > 1 ? ctx_.pool.take(scratch_bytes) : nullptr;
        launch::reduce(op.kind == K::reduce_max, x->type.dtype, s, x->data, out.data, scratch, stream_);
        ctx_.pool.give(scratch, scratch_bytes);
        break;
      }
      case K::broadcast_in_dim:
        copy(broadcast_view(x->type.shape, a), x->data, out.data, op.type.dtype, stream_);
        break;
      case K::reshape:
        if (n > 0)
          check_cuda(cudaMemcpyAsync(out.data, x->data, static_cast<std::size_t>(op.type.bytes()), cudaMemcpyDeviceToDevice, stream_),
                     "cudaMemcpyAsync");
        break;
      case K::transpose:
        copy(transpose_view(x->type.shape, a, op.type.shape), x->data, out.data, op.type.dtype, stream_);
        break;
      case K::slice:
        copy(slice_view(x->type.shape, a, op.type.shape), x->data, out.data, op.type.dtype, stream_);
        break;
      case K::pad:
        check_cuda(cudaMemsetAsync(out.data, 0, static_cast<std::size_t>(op.type.bytes()), stream_), "cudaMemsetAsync");
        copy(pad_view(x->type.shape, a, op.type.shape), x->data, out.data, op.type.dtype, stream_);
        break;
      case K::concatenate: {
        std::int64_t at = 0;
        for (const Buffer* part : in) {
          copy(concatenate_view(part->type.shape, a.axis, at, op.type.shape), part->data, out.data, op.type.dtype, stream_);
          at += part->type.shape[static_cast<std::size_t>(a.axis)];
        }
        break;
      }
      case K::convolution: {
        const Shape& w = in[1]->type.shape;
        launch::convolution(op.type.dtype, kernels::convolution_shape(x->type.shape, w, op.type.shape, a), x->type.shape.front(),
                            x->type.shape.back(), w.back(), a.conv.feature_groups, x->data, in[1]->data, out.data, stream_);
        break;
      }
      case K::reduce_window_sum: case K::reduce_window_max:
        launch::reduce_window(op.kind == K::reduce_window_max, op.type.dtype,
                              kernels::window_shape(op.kind, x->type.shape, a.window.window, op.type.shape, a), x->data, out.data, stream_);
        break;
      case K::select_and_scatter:  // x, g (one value per window) -> x's shape
        check_cuda(cudaMemsetAsync(out.data, 0, static_cast<std::size_t>(op.type.bytes()), stream_), "cudaMemsetAsync");
        launch::select_and_scatter(op.type.dtype, kernels::window_shape(op.kind, x->type.shape, a.window.window, in[1]->type.shape, a),
                                   x->data, in[1]->data, out.data, stream_);
        break;
      case K::gather: {  // table [V, F...], indices [I...] -> [I..., F...]
        const std::int64_t rows = x->type.shape.at(0), row = rows ? x->type.elements() / rows : 0;
        launch::gather(op.type.dtype, x->data, static_cast<const std::int32_t*>(in[1]->data), out.data,
                       in[1]->type.elements(), rows, row, global_rows < 0 ? 0 : first_row,
                       global_rows < 0 ? rows : global_rows, ctx_.bad_index, stream_);
        break;
      }
      case K::scatter_add: {  // indices [I...], updates [I..., F...] -> [V, F...]
        check_cuda(cudaMemsetAsync(out.data, 0, static_cast<std::size_t>(op.type.bytes()), stream_), "cudaMemsetAsync");
        const std::int64_t rows = op.type.shape.at(0), row = rows ? n / rows : 0;
        launch::scatter_add(op.type.dtype, static_cast<const std::int32_t*>(x->data), in[1]->data, out.data,
                            x->type.elements(), rows, row, global_rows < 0 ? 0 : first_row,
                            global_rows < 0 ? rows : global_rows, ctx_.bad_index, stream_);
        break;
      }
    }
    return out;
  }

 private:
  const Mesh& mesh_;
  nccl::Communicator& comm_;
  Context& ctx_;
  cudaStream_t stream_;
};

}  // namespace detail

// Runs an unfused plan (PlanOptions::fuse false: the GPU runs every op by itself), freeing by its frees.
inline DeviceResult execute(const ExecutionPlan& plan, nccl::Communicator& comm, const NamedArrays& inputs,
                            const ExecuteOptions& options = {}) {
  const SpmdProgram& p = plan.program();
  const Mesh& mesh = p.mesh();
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
  if (ctx.reserved_for != &p) {  // first run of this program here: size the pool by its liveness plan
    ctx.pool.reserve(plan_pool(stage).blocks);
    ctx.reserved_for = &p;
  }
  const cudaStream_t stream = comm.stream();
  check_cuda(cudaMemsetAsync(ctx.bad_index, 0, sizeof(int), stream), "cudaMemsetAsync");
  detail::Runner run(p, comm, ctx);

  const auto n = static_cast<std::size_t>(p.size());
  std::vector<Buffer> values(n);
  DeviceResult result;
  std::int64_t resident = 0;
  for (const auto& b : p.inputs()) {
    const Array& given = partir::detail::checked_input(p, b, inputs, options, where);
    auto& slot = values[static_cast<std::size_t>(b.value)];
    if (slot.data) continue;  // the same value bound twice
    slot = options.global_inputs ? run.upload(layout::shard(given, b.sharding, mesh, comm.device())) : run.upload(given);
    resident += p.type(b.value).bytes();
  }
  std::int64_t peak = resident;
  const auto& frees = stage.frees();
  // Donated state (ExecuteOptions::donate): the GPU's copy is freed after its last use; the host's stays.
  const std::vector<bool> donated = options.donate ? stage.donated : std::vector<bool>(n, false);
  // Around the ops (inputs uploaded, outputs not yet downloaded): what the GPU computes, apart from the copies.
  cudaEvent_t ops_start = nullptr, ops_stop = nullptr;
  check_cuda(cudaEventCreate(&ops_start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&ops_stop), "cudaEventCreate");
  check_cuda(cudaEventRecord(ops_start, stream), "cudaEventRecord");
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> timed;  // around each collective, read after the run
  std::vector<const Buffer*> operands;
  for (ValueId v = 0; v < p.size(); ++v) {
    const SpmdOp& s = p.op(v);
    auto& slot = values[static_cast<std::size_t>(v)];
    if (s.op.kind == OpKind::input && !s.collective) {
      if (!slot.data && s.op.type.bytes() > 0) internal_error(where + ": input %" + std::to_string(v) + " has no binding");
    } else {
      operands.clear();
      for (auto o : s.op.operands) operands.push_back(&values[static_cast<std::size_t>(o)]);
      try {
        if (s.collective) {
          cudaEvent_t start = nullptr, stop = nullptr;
          check_cuda(cudaEventCreate(&start), "cudaEventCreate");
          check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
          check_cuda(cudaEventRecord(start, stream), "cudaEventRecord");
          slot = run.collective(*s.collective, *operands[0], s.op.type);
          check_cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
          timed.emplace_back(start, stop);
        } else if (!s.row_shard.empty()) {
          const auto rows = (s.op.kind == OpKind::gather ? operands[0]->type.shape : s.op.type.shape).at(0);
          slot = run.eval(s.op, operands, mesh.position(comm.device(), s.row_shard) * rows,
                          rows * tile_count(s.row_shard, mesh));
        } else {
          slot = run.eval(s.op, operands);
        }
      } catch (const UserError& e) {
        // Blocks given back earlier in this run may still be in use by queued work: let it finish before the
        // pool can hand them to work on another stream (a later run on another communicator).
        cudaStreamSynchronize(stream);
        cudaGetLastError();
        cudaEventDestroy(ops_start);
        cudaEventDestroy(ops_stop);
        user_error(where + ": %" + std::to_string(v) + ": " + e.what());
      }
      resident += slot.type.bytes();
      peak = std::max(peak, resident);
    }
    for (auto dead : frees[static_cast<std::size_t>(v)]) {
      const bool kept = partir::detail::is_program_input(p.op(dead)) && !donated[static_cast<std::size_t>(dead)];
      auto& buffer = values[static_cast<std::size_t>(dead)];
      if (kept || !buffer.data) continue;  // inputs stay resident, as in the CPU executor's accounting
      resident -= buffer.type.bytes();
      run.give(buffer);
    }
  }
  result.peak_bytes = peak;
  check_cuda(cudaEventRecord(ops_stop, stream), "cudaEventRecord");

  std::vector<Buffer> extra;  // buffers made for gathered outputs
  std::vector<std::pair<std::string, Array>> downloads;
  for (const auto& b : p.outputs()) {
    Buffer piece = values[static_cast<std::size_t>(b.value)];
    if (options.global_outputs) {
      Shape shape = piece.type.shape;
      if (!b.sharding.partial.empty()) {
        piece = run.collective({CollectiveKind::all_reduce, b.sharding.partial}, piece, piece.type);
        extra.push_back(piece);
      }
      for (std::size_t d = 0; d < b.sharding.dims.size(); ++d) {
        if (b.sharding.dims[d].empty()) continue;
        shape[d] = b.global.shape[d];
        piece = run.collective({CollectiveKind::all_gather, b.sharding.dims[d], static_cast<std::int64_t>(d)}, piece,
                               TensorType{shape, piece.type.dtype});
        extra.push_back(piece);
      }
    }
    downloads.emplace_back(b.name, run.download(piece));
  }
  comm.synchronize();
  int bad = 0;
  check_cuda(cudaMemcpy(&bad, ctx.bad_index, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
  float ops_ms = 0;
  check_cuda(cudaEventElapsedTime(&ops_ms, ops_start, ops_stop), "cudaEventElapsedTime");
  result.gpu_seconds = ops_ms / 1e3;
  cudaEventDestroy(ops_start);
  cudaEventDestroy(ops_stop);
  for (auto& [start, stop] : timed) {
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    result.collective_seconds.push_back(ms / 1e3);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  for (auto& b : extra) run.give(b);
  for (auto& b : values)
    if (b.data) run.give(b);
  if (bad)
    user_error(where + ": a gather or scatter_add index is out of range of its table (found on the GPU; run on the CPU "
               "backend to see which index)");
  for (auto& [name, array] : downloads) result.outputs[name] = std::move(array);
  return result;
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
