// Trains a byte-level GPT on examples/data/corpus.txt (the program: gpt_train.hpp).
//   build/examples/gpt_train --steps 300 --sample 200
//   build/examples/gpt_train --mesh batch=2,model=2 --schedule bp,mp,z3,emb
//   mpirun -np 4 build/examples/gpt_train --backend mpi --mesh batch=2,model=2 --schedule bp,mp,z3
#include "gpt_train.hpp"

int main(int argc, char** argv) {
  return gpt::train_main(argc, argv, {.description = "Trains a byte-level GPT on a text file with partir.", .name = "gpt_train"});
}
