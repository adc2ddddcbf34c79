// Run under mpirun -np 4: every collective of the MPI backend against locally computed expectations.
#include <partir/runtime/mpi.hpp>

#include <cstdio>
#include <cstring>

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
    // all_reduce as the backend picks it by size, then always the ring (small and odd counts too), then MPI's.
    for (Algorithm a : {Algorithm::automatic, Algorithm::ring, Algorithm::library}) {
      c.set_all_reduce_algorithm(a);
      wrong += collective_checks::check_all(c);
    }
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
