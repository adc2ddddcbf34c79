// Run under mpirun -np 4: every collective of the MPI backend against locally computed expectations.
#include <partir/runtime/mpi.hpp>

#include <cstdio>

#include "collective_checks.hpp"

int main(int argc, char** argv) {
  partir::mpi::Session session(argc, argv);
  if (session.size() != 4) {
    std::fprintf(stderr, "mpi_collectives needs 4 ranks, got %d\n", session.size());
    return 2;
  }
  long wrong = 0;
  {
    partir::mpi::Communicator c;
    static_assert(partir::Communicator<partir::mpi::Communicator>);
    wrong = collective_checks::check_all(c);
  }
  long total = 0;
  MPI_Allreduce(&wrong, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (session.rank() == 0) std::printf("mpi collectives: %ld wrong elements\n", total);
  return total == 0 ? 0 : 1;
}
