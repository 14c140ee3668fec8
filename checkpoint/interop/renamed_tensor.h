#pragma once
// One of our tensors as a file made elsewhere holds it: under another name,
// or split along dim 0 into one tensor per row, that dim dropped. Hugging
// Face saves a mixture of experts' stacked experts [E, out, in] as E tensors
// [out, in] (model.layers.N.mlp.experts.K.gate_proj.weight), and Mixtral
// calls the router block_sparse_moe.gate. Plain data, torch-free: the model
// kind's adapter says which tensors (framework/config/run_items.h,
// hf_renames); checkpoint/ only moves the bytes.
//
//   WeightsFile::renamed     reads a file made elsewhere under our names
//                            (model.init_from, generate, ckpt import-hf);
//   RunAdapter::hf_renames   writes Hugging Face's names on export.
#include <string>
#include <vector>

namespace checkpoint {

struct RenamedTensor {
  std::string name;                // ours (a model parameter, without "model.")
  std::vector<std::string> parts;  // the file's: one name, or one per row of dim 0 when split
  bool split = false;              // false: parts holds one name, of the same shape
};

}  // namespace checkpoint
