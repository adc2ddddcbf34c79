#pragma once
// Starting the NCCL backend under mpirun: rank 0 makes the ncclUniqueId and MPI_Bcast sends it to every
// rank; each rank takes the GPU of its index among the ranks on its node (so N ranks on a node of N GPUs
// use one GPU each). MPI only bootstraps: every collective then goes through NCCL.
#include "partir/runtime/comm/mpi.hpp"
#include "partir/runtime/comm/nccl.hpp"

namespace partir::nccl {

// The NCCL communicator for this MPI rank (an mpi::Session must be alive). Needs as many GPUs on the node
// as ranks on it.
inline std::unique_ptr<Communicator> from_mpi() {
  int rank = 0, ranks = 1, local = 0, local_ranks = 1;
  mpi::check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  mpi::check(MPI_Comm_size(MPI_COMM_WORLD, &ranks), "MPI_Comm_size");
  MPI_Comm node;
  mpi::check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
  MPI_Comm_rank(node, &local);
  MPI_Comm_size(node, &local_ranks);
  MPI_Comm_free(&node);
  // Every rank checks its GPUs before the broadcast, and all agree on the outcome, so that a machine
  // without enough GPUs fails with the same message everywhere instead of hanging in ncclCommInitRank.
  const int present = gpu::device_count();
  int ok = present >= local_ranks ? 1 : 0, all_ok = 0;
  mpi::check(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD), "MPI_Allreduce");
  if (!all_ok) {
    if (present == 0) user_error(gpu::no_device_message("nccl::from_mpi (rank " + std::to_string(rank) + ")"));
    user_error("nccl::from_mpi: " + std::to_string(local_ranks) + " ranks share a node that has " +
               std::to_string(present) + " CUDA devices (on rank " + std::to_string(rank) +
               "'s node, or another's); NCCL needs one GPU per rank");
  }
  ncclUniqueId id{};
  if (rank == 0) id = unique_id();
  mpi::check(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast (ncclUniqueId)");
  return std::make_unique<Communicator>(ranks, rank, id, local);
}

}  // namespace partir::nccl
