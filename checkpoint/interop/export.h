#pragma once
// Consolidating a sharded checkpoint into one file of full tensors that other
// tools read: safetensors, or a torch.save archive that Python's
// torch.load(f, weights_only=True) accepts. Torch-free (ckpt export uses it).
//
// Memory stays bounded whatever the model size: items are written one after
// another, each in slabs along dim 0 of at most `slab_bytes` (at least one
// row of dim 0): for every slab the reads that fill it are planned with
// plan_reads and only the blocks overlapping it are decoded. For the usual
// dim-0 split, a slab is a contiguous range of one or two saved chunks; for
// other splits (column shards, general boxes) it gathers rows from several
// chunks, still within the slab. The output is written to <out>.tmp, fsynced
// and renamed to <out>, so a failed export leaves no partial file under <out>.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/format/types.h"
#include "checkpoint/interop/renamed_tensor.h"
#include "checkpoint/storage/storage.h"

namespace checkpoint {

enum class ExportFormat { kSafetensors, kTorch, kDcp, kHf, kPeft };

// The AdamW param group a DCP export records (optim.param_groups.0.*), as
// torch 2.6's AdamW keys it; ckpt fills it from the checkpoint's config.
struct DcpParamGroup {
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

// A LoRA run's adapters (RunAdapter::lora): the settings PEFT's
// adapter_config.json holds, and the base the run started from.
struct LoraInfo {
  int64_t rank = 0;
  double alpha = 0;
  double dropout = 0;
  std::vector<std::string> targets;  // projection names, e.g. q_proj, v_proj
  // The base's weights (a Hugging Face directory) and their
  // weights_content_hash (hf.h); both empty for a randomly initialised base.
  std::string base_path;
  std::string base_hash;
};

// One of a LoRA run's adapter tensors (RunAdapter::lora_tensor): the model
// parameter it changes and which factor it is (A [rank, in] or B [out,
// rank]; the merged weight is W + alpha / rank x B A).
struct LoraTensor {
  std::string target;
  bool is_a = false;
};

// What checkpoint/ does not know of the run that wrote a checkpoint. To
// this library the run's settings are bytes items like any other; a run
// adapter, implemented above it, reads them: the trainer's
// (framework/config/run_items.h, make_run_adapter: its config item and the
// model kind's Hugging Face adapter). Exports consult it through
// ExportOptions::run.
class RunAdapter {
 public:
  virtual ~RunAdapter() = default;
  // Reads a bytes item of the checkpoint: its bytes, or nullopt when the
  // checkpoint has no such item.
  using ReadBytesItem = std::function<std::optional<std::string>(const std::string& name)>;
  // config.json of the Hugging Face model in the checkpoint at `where`, its
  // weights as `torch_dtype`; nullopt when the checkpoint records no run
  // settings. Throws FormatError naming `where` when the run's model has no
  // Hugging Face counterpart or its settings cannot be read.
  virtual std::optional<std::string> hf_config_json(const ReadBytesItem& read, const std::string& where,
                                                    const std::string& torch_dtype) const = 0;
  // The optimizer settings the run trained with; `fallback` where it
  // records none. Throws FormatError naming `where` (the checkpoint's
  // directory) when its settings cannot be read.
  virtual DcpParamGroup optimizer_param_group(const ReadBytesItem& read, const std::string& where,
                                              const DcpParamGroup& fallback) const = 0;
  // The tokenizer file the run trained with; "" for none (or bytes). Throws
  // as optimizer_param_group.
  virtual std::string tokenizer(const ReadBytesItem& read, const std::string& where) const = 0;
  // The LoRA adapters of a run that trained them (its checkpoints hold the
  // adapters, not the frozen base); nullopt for any other run. Throws as
  // optimizer_param_group.
  virtual std::optional<LoraInfo> lora(const ReadBytesItem& /*read*/, const std::string& /*where*/) const {
    return std::nullopt;
  }
  // The model parameters that the Hugging Face model of `config_json` (the
  // config.json an HF export writes) names or lays out otherwise than the
  // checkpoint does: a mixture of experts' stacked experts, one tensor per
  // expert there. Empty: every name is Hugging Face's (the dense llama), or
  // `config_json` is not one it reads (a checkpoint of ckpt import-hf of
  // another model keeps the directory's names). `where`: the checkpoint.
  virtual std::vector<RenamedTensor> hf_renames(const std::string& /*config_json*/,
                                                const std::string& /*where*/) const {
    return {};
  }
  // Whether model parameter `parameter` (a model.* item without its
  // prefix) is a LoRA adapter tensor, and of which parameter; nullopt for
  // any other (the model's own naming: checkpoint/ knows none).
  virtual std::optional<LoraTensor> lora_tensor(const std::string& /*parameter*/) const { return std::nullopt; }
};

struct ExportOptions {
  ExportFormat format = ExportFormat::kSafetensors;
  // Convert floating-point tensors (float32/float64/float16/bfloat16) to
  // this type: kFloat32 or kBFloat16 (float32 -> bfloat16 rounds to nearest
  // even, NaN stays NaN, as torch's .to(torch.bfloat16) does; float64 goes
  // via float32). Other tensors are written unchanged. nullopt: keep dtypes.
  std::optional<DType> dtype;
  // Non-empty: only items named "<only>.<rest>" are exported, as "<rest>"
  // (e.g. "model" exports the model's parameter names). Empty: every tensor
  // item under its full name. Bytes items are never exported.
  std::string only;
  int io_threads = 4;
  uint64_t slab_bytes = uint64_t{64} << 20;
  std::shared_ptr<Storage> storage;  // null: the POSIX file system
  // kDcp: the optimizer's param group; `only` "model" leaves the optimizer out.
  DcpParamGroup dcp_param_group;
  // kHf: the most tensor bytes of one safetensors shard (a tensor larger
  // than this gets a shard of its own), as save_pretrained's max_shard_size.
  uint64_t max_shard_bytes = uint64_t{5} * 1000 * 1000 * 1000;
  // kHf: the tokenizer to ship beside the model: a Hugging Face
  // tokenizer.json or a SentencePiece .model, copied as tokenizer.json or
  // tokenizer.model with the tokenizer_config.json found beside it (else a
  // minimal one). Empty: the run's tokenizer (RunAdapter::tokenizer), when
  // that file exists; "none": no tokenizer files.
  std::string tokenizer;
  // kHf of a LoRA checkpoint: write the base with every adapter merged,
  // W + (alpha / rank) B A (computed in double, rounded once), instead of
  // refusing a checkpoint that holds only adapters. Floats are written as
  // float32 unless `dtype` says otherwise.
  bool merge_lora = false;
  // kHf with merge_lora, kPeft: the base's weights. Empty: the directory the
  // run recorded. Either way its weights_content_hash must equal the one
  // the run recorded (a FormatError names both paths and hashes).
  std::string base;
  // The run's settings (kHf: config.json; kDcp: the param group; kHf: the
  // tokenizer; kHf and kPeft: the LoRA adapters). Null: none are read (kHf then needs the config.json that
  // import_hf_checkpoint recorded).
  std::shared_ptr<const RunAdapter> run;
};

struct ExportStats {
  uint64_t tensors = 0;
  uint64_t data_bytes = 0;           // tensor bytes written (after conversion)
  uint64_t file_bytes = 0;           // size of the output file
  std::vector<std::string> skipped;  // bytes items, and items outside `only`
  std::string tokenizer;             // kHf: the tokenizer file shipped, or empty
  std::string tokenizer_missing;     // kHf: the run's tokenizer, not found (so not shipped)
};

// Reads the committed checkpoint `step_dir` and writes `out_path`.
// kPeft (a LoRA run's checkpoint, options.run) writes the directory PEFT's
// PeftModel.from_pretrained reads: adapter_model.safetensors, each adapter
// model.<name>.lora_{A,B}.weight as base_model.model.<name>.lora_{A,B}.weight
// (float32 unless `dtype`), and adapter_config.json (peft_type LORA,
// task_type CAUSAL_LM, r, lora_alpha, lora_dropout, target_modules,
// base_model_name_or_path: the recorded base).
// kHf writes a Hugging Face model directory `out_path` (as <out_path>.tmp,
// renamed): the model's tensors under their own names (or those
// RunAdapter::hf_renames gives: a stacked expert tensor [E, ...] as E
// tensors, each streamed from its rows) in safetensors shards
// of at most max_shard_bytes (model.safetensors when one is enough, else
// model-0000K-of-0000N.safetensors with model.safetensors.index.json), and
// config.json from the run's settings (options.run: the built-in llama's is
// LlamaForCausalLM's) or, for a checkpoint made by import_hf_checkpoint, the
// config.json it recorded.
// kDcp writes a directory `out_path` that PyTorch's dcp.load reads (torch
// 2.6 and later) into get_state_dict(model, optim) of a model with the same
// parameter names, at any world size: model.<name> tensors; for each
// trainable parameter optim.state.<name>.exp_avg / exp_avg_sq and .step (a
// 0-d float32 tensor); optim.param_groups.0.{lr, betas, eps, weight_decay,
// amsgrad, foreach, maximize, capturable, differentiable, fused,
// decoupled_weight_decay (torch 2.7 and later), params}.
// Each tensor is written as chunks of dim-0 slabs (each a torch.save archive
// in __0_0.distcp), then .metadata; the directory is written as
// <out_path>.tmp and renamed. `dtype` must be unset for kDcp. Throws
// std::invalid_argument for a `dtype` other than float32/bfloat16;
// FormatError naming the checkpoint for a directory without committed
// metadata or with nothing to export; read errors
// (FormatError, ChecksumError, IoError, TransformError) name the directory,
// the item and the file; IoError for the output.
ExportStats export_checkpoint(const std::string& step_dir, const std::string& out_path,
                              const ExportOptions& options);

// Element conversion of the exports (export.cpp, hf.cpp): converts `n`
// elements from `from` to `to`, both floating-point types, `to` being kFloat32
// or kBFloat16. dst must hold n * element_size(to) bytes.
void convert_float_elements(DType from, DType to, const uint8_t* src, uint64_t n, uint8_t* dst);
// float32 -> bfloat16, round to nearest even; NaN -> 0x7FC0, as
// c10::BFloat16(float) does (torch's vectorized CPU .to() gives 0xFFFF, also
// a NaN; no other value differs).
uint16_t float_to_bfloat16_bits(float value);

}  // namespace checkpoint
