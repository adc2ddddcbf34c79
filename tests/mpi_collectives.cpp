// Run under mpirun -np 4: every collective of the MPI backend against locally computed expectations.
#include <partir/runtime/comm/mpi.hpp>
#include <partir/calibrate/calibrate.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <limits>

#include "collective_checks.hpp"

int main(int argc, char** argv) {
  partir::mpi::Session session(argc, argv);
  if (session.size() != 4) {
    std::fprintf(stderr, "mpi_collectives needs 4 ranks, got %d\n", session.size());
    return 2;
  }
  using Algorithm = partir::mpi::Communicator::AllReduceAlgorithm;
  long wrong = 0;
  {
    partir::mpi::Communicator c;
    static_assert(partir::Communicator<partir::mpi::Communicator>);
    // The 4 ranks share this host: its shared memory carries every group's collectives (unless PARTIR_MPI_SHM=0).
    const char* shm_env = std::getenv("PARTIR_MPI_SHM");
    if (!c.shared_memory().available() && !(shm_env && std::string(shm_env) == "0")) {
      std::fprintf(stderr, "rank %d: no shared-memory transport: %s\n", c.device(),
                   c.shared_memory().unavailable_reason().c_str());
      ++wrong;
    }
    // How the group of all 4 reduces and gathers: within this host, or in two levels where 2 hosts hold 2 ranks each
    // (multihost.py runs this program so and looks for the line).
    const partir::Group all{{0, 1, 2, 3}};
    if (c.device() == 0)
      std::printf("shared memory: %d ranks on this host; all_reduce, reduce_scatter, all_gather over all 4: %s\n",
                  c.shared_memory().ranks_on_this_host(),
                  c.shared_memory().covers(all)   ? "within the host"
                  : c.shared_memory().levels(all) ? "in two levels"
                                                  : "MPI");
    // all_reduce as the backend picks it, then always the ring (small and odd counts too), then MPI's, then
    // shared memory; the other collectives through shared memory, then through MPI alone.
    for (Algorithm a : {Algorithm::automatic, Algorithm::ring, Algorithm::library, Algorithm::shared_memory}) {
      c.set_all_reduce_algorithm(a);
      wrong += collective_checks::check_all(c);
    }
    c.set_shared_memory(false);
    c.set_all_reduce_algorithm(Algorithm::automatic);
    wrong += collective_checks::check_all(c);
  }
  // Shared memory in steps of 4 KiB: every collective above a few hundred elements takes several steps (both
  // halves of each slot), slices of unequal length included.
  {
    partir::mpi::Communicator c(4096);
    wrong += c.shared_memory().available() && c.shared_memory().chunk_bytes() != 4096;
    wrong += collective_checks::check_all(c);
  }
  // Automatic choice by size: the default crossover, then a profile's per group size (tune_collectives): pairs
  // from 4 KiB, the 4-rank group never; the checks again under that choice. Calibration times both algorithms
  // and leaves the choice as it found it.
  {
    constexpr auto never = partir::ring_all_reduce_never;
    partir::mpi::Communicator c;
    static_assert(partir::ChoosesAllReduce<partir::mpi::Communicator>);
    const auto from = partir::mpi::Communicator::default_ring_all_reduce_from;
    wrong += c.use_ring_all_reduce(4, from - 1) || !c.use_ring_all_reduce(4, from) || c.use_ring_all_reduce(1, from);
    partir::HardwareProfile hw;
    hw.ring_all_reduce_from = {{2, 4096}, {4, never}};
    partir::tune_collectives(c, hw);
    wrong += c.use_ring_all_reduce(2, 4095) || !c.use_ring_all_reduce(2, 4096) || c.use_ring_all_reduce(4, never - 1);
    wrong += collective_checks::check_all(c);
    const partir::CalibrationOptions quick{.warmup = 1, .iterations = 2, .rounds = 1,
                                           .all_reduce_choice_bytes = {1 << 12, 1 << 16}};
    const std::int64_t measured = partir::calibration::ring_all_reduce_from(c, 2, quick);
    wrong += measured != 4096 && measured != 65536 && measured != never;
    wrong += c.ring_all_reduce_from(2) != 4096 || c.ring_all_reduce_from(4) != never;
  }
  // E103 an unknown all_reduce algorithm in $PARTIR_MPI_ALL_REDUCE: the name and the choices.
  try {
    partir::mpi::Communicator::parse_all_reduce_algorithm("tree");
    ++wrong;
  } catch (const partir::UserError& e) {
    wrong += std::strstr(e.what(), "PARTIR_MPI_ALL_REDUCE: unknown all_reduce algorithm 'tree' (auto:") == nullptr;
  }
  long total = 0;
  MPI_Allreduce(&wrong, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (session.rank() == 0) std::printf("mpi collectives: %ld wrong elements\n", total);
  return total == 0 ? 0 : 1;
}
