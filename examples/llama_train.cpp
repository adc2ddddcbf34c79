// Trains a byte-level Llama (nn::Llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, Hugging
// Face's parameter names) on examples/data/corpus.txt (the program: gpt_train.hpp).
//   build/examples/llama_train --steps 300
//   build/examples/llama_train --mesh batch=2,model=2 --schedule bp,mp,z3 --heads 8 --kv-heads 2 --save-safetensors llama
//   mpirun -np 4 build/examples/llama_train --backend mpi --mesh batch=2,model=2 --schedule bp,mp,z3
//   build/examples/llama_train --mesh model=4 --schedule mp --heads 8 --kv-heads 2 --load-safetensors llama
#include "gpt_train.hpp"

int main(int argc, char** argv) {
  return gpt::train_main(argc, argv,
                         {.description = "Trains a byte-level Llama (GQA, RoPE, SwiGLU, RMSNorm) on a text file with partir.",
                          .name = "llama_train", .llama = true});
}
