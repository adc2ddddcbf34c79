// Trains a byte-level GPT whose MLPs are mixtures of experts (GShard / Switch: top-1 or top-2 routing with a
// capacity factor; dsl/moe.hpp) on examples/data/corpus.txt, by default with expert parallelism: the experts
// and the tokens split over the `expert` axis, tokens sent to their experts and back by all_to_all.
//   build/examples/moe_train
//   build/examples/moe_train --mesh batch=2,expert=2 --schedule bp,ep --top-k 2
//   mpirun -np 4 build/examples/moe_train --backend mpi --mesh batch=2,expert=2 --schedule bp,ep
#include "gpt_train.hpp"

int main(int argc, char** argv) {
  return gpt::train_main(argc, argv,
                         {.description = "Trains a byte-level mixture-of-experts GPT on a text file with partir.",
                          .name = "moe_train", .mesh = "expert=2", .schedule = "ep", .experts = 4});
}
