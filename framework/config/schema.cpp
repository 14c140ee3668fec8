#include "framework/config/schema.h"

#include "models/options.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <type_traits>

namespace framework::config {
namespace {

Value to_value(int64_t v) { return Value(v); }
Value to_value(int v) { return Value(static_cast<int64_t>(v)); }
Value to_value(double v) { return Value(v); }
Value to_value(bool v) { return Value(v); }
Value to_value(const std::string& v) { return Value(v); }

// Narrowing to int is safe: every int field has bounds inside int's range.
void from_value(const Value& v, int64_t& dst) { dst = std::get<int64_t>(v); }
void from_value(const Value& v, int& dst) { dst = static_cast<int>(std::get<int64_t>(v)); }
void from_value(const Value& v, double& dst) { dst = std::get<double>(v); }
void from_value(const Value& v, bool& dst) { dst = std::get<bool>(v); }
void from_value(const Value& v, std::string& dst) { dst = std::get<std::string>(v); }

template <typename T>
constexpr ValueType value_type_of() {
  if constexpr (std::is_same_v<T, bool>) return ValueType::kBool;
  else if constexpr (std::is_integral_v<T>) return ValueType::kInt;
  else if constexpr (std::is_floating_point_v<T>) return ValueType::kFloat;
  else return ValueType::kString;
}

// Expands to the path, type, getter and setter of one Config field, so the
// key string can never drift from the field it names.
#define SHARDKIT_CONFIG_FIELD(field)                               \
  #field, value_type_of<decltype(Config{}.field)>(),               \
      [](const Config& c) { return to_value(c.field); },           \
      [](Config& c, const Value& v) { from_value(v, c.field); }

// The same for a field of an enum type: YAML text through to_string and
// `parse` (the enum's one parse function; one_of_enum gives its constraint,
// which the loader checks first, so `parse` never throws here).
#define SHARDKIT_CONFIG_ENUM(field, parse)                                     \
  #field, ValueType::kString,                                                  \
      [](const Config& c) { return Value(std::string(to_string(c.field))); },  \
      [](Config& c, const Value& v) { c.field = parse(std::get<std::string>(v)); }

// The allowed values of an enum key: the spellings of `values`, in order.
template <typename Enum, size_t N>
Constraint one_of_enum(const Enum (&values)[N]) {
  std::vector<std::string> choices;
  for (Enum value : values) choices.push_back(to_string(value));
  return one_of(std::move(choices));
}

// checkpoint.direct_io was a bool: the other spellings parse_bool took still
// parse (parse_direct_io), unnamed in messages.
Constraint direct_io_values() {
  Constraint c = one_of_enum(checkpoint::kDirectIos);
  c.also_accepted = {"True", "False", "TRUE", "FALSE"};
  return c;
}

fsdp::PrecisionDtype parse_param_dtype(const std::string& text) {
  return fsdp::parse_precision_dtype(text, "train.mixed_precision.param_dtype");
}

fsdp::PrecisionDtype parse_reduce_dtype(const std::string& text) {
  return fsdp::parse_precision_dtype(text, "train.mixed_precision.reduce_dtype");
}

std::vector<Key> build_schema() {
  return {
      {SHARDKIT_CONFIG_FIELD(run.dir), non_empty(),
       "Run directory: metrics.jsonl, config.yaml and (by default) checkpoints."},
      {SHARDKIT_CONFIG_FIELD(run.seed), at_least(0),
       "Seed of parameter init and synthetic data."},
      {SHARDKIT_CONFIG_ENUM(run.host_malloc, comm::parse_host_malloc), one_of_enum(comm::kHostMallocs),
       "Host memory the process frees: keep: glibc keeps it for reuse (mmap threshold 32 MiB, "
       "trim threshold 1 GiB), so steps do not fault their buffers in again (resident memory "
       "stays near its peak); default: glibc's adaptive thresholds. MALLOC_MMAP_THRESHOLD_, "
       "MALLOC_TRIM_THRESHOLD_ or MALLOC_TOP_PAD_ in the environment win over keep."},

      {SHARDKIT_CONFIG_FIELD(train.steps), at_least(1), "Number of optimizer steps."},
      {SHARDKIT_CONFIG_FIELD(train.stop_at), at_least(0),
       "Exit cleanly after this step, as a preempted job would; 0: never."},
      {SHARDKIT_CONFIG_FIELD(train.global_batch_size), at_least(1),
       "Sequences per step, summed over all ranks."},
      {SHARDKIT_CONFIG_FIELD(train.log_every), at_least(1), "Log metrics every N steps."},
      {SHARDKIT_CONFIG_FIELD(train.eval_every), at_least(0),
       "Validation loss on the held-out data (data.eval_fraction) every N steps and at the "
       "last; 0: off."},
      {SHARDKIT_CONFIG_FIELD(train.eval_samples), at_least(1),
       "Held-out samples per validation (fewer when the held-out text is shorter)."},
      {SHARDKIT_CONFIG_FIELD(train.sample_every), at_least(0),
       "Print a greedy continuation of train.sample_prompt every N steps and at the last; 0: "
       "off. Text through data.tokenizer (without one, bytes: model.vocab_size 256); a built-in "
       "model."},
      {SHARDKIT_CONFIG_FIELD(train.sample_prompt), any_value(), "The text train.sample_every continues."},
      {SHARDKIT_CONFIG_FIELD(train.sample_tokens), between(1, 4096), "Tokens each sample generates."},
      {SHARDKIT_CONFIG_ENUM(train.device, comm::parse_device_kind), one_of_enum(comm::kDeviceKinds),
       "Device the model trains on."},
      {SHARDKIT_CONFIG_FIELD(train.deterministic), any_value(),
       "CUDA: deterministic kernels (cuBLAS workspace config, deterministic algorithms), so that "
       "a resumed run is bit-identical to an uninterrupted one; false: PyTorch's default "
       "kernels, faster, and resume is then exact only to rounding."},
      {SHARDKIT_CONFIG_ENUM(train.optimizer_impl, optim::parse_optimizer_impl), one_of_enum(optim::kOptimizerImpls),
       "AdamW's implementation: fused (torch.optim.AdamW(fused=True)'s kernel, LibTorch 2.4+), "
       "foreach (multi-tensor ops, as foreach=True), for_loop (LibTorch's C++ AdamW, a few "
       "kernels per parameter); auto: fused where the build has it, else foreach on CUDA and "
       "for_loop on the CPU (the faster there on LibTorch 1.13). All keep the "
       "same state: a checkpoint resumes under any of them. The banner names the one picked."},
      {SHARDKIT_CONFIG_FIELD(train.fused_kernels), any_value(),
       "Fused ops in the model where one exists: RMSNorm as LibTorch's one rms_norm op (LibTorch "
       "2.4+; before, the composed ops), the loss over the vocabulary in chunks that never hold "
       "the whole batch's fp32 logits; false: the composed ops (to compare speed in one run)."},
      {SHARDKIT_CONFIG_FIELD(train.peak_tflops), auto_or_above(0),
       "One device's peak TFLOP/s for MFU (model FLOPs utilisation: the model's training FLOPs "
       "per token x tokens/s over the job's devices' peak), shown in the progress line and "
       "metrics.jsonl; auto (0): a CUDA device's bf16 dense peak from a table of known GPUs "
       "(H100, H200, A100, ...), and no MFU on the CPU."},
      {SHARDKIT_CONFIG_FIELD(train.grad_clip), at_least(0),
       "Clip gradients to this global L2 norm; 0: no clipping."},
      {SHARDKIT_CONFIG_FIELD(train.micro_batch_size), at_least(0),
       "Sequences per rank per forward: a step accumulates the gradients of "
       "global_batch_size / (micro_batch_size x data-parallel ranks) micro-batches; 0: the "
       "rank's whole share in one forward."},
      {SHARDKIT_CONFIG_ENUM(train.mixed_precision.param_dtype, parse_param_dtype), one_of_enum(fsdp::kPrecisionDtypes),
       "Dtype units are all-gathered and computed in; the sharded (master) parameters and "
       "AdamW stay fp32."},
      {SHARDKIT_CONFIG_ENUM(train.mixed_precision.reduce_dtype, parse_reduce_dtype), one_of_enum(fsdp::kPrecisionDtypes),
       "Dtype gradients are reduce-scattered (all-reduced for DDP) in, before they are added "
       "to the fp32 shard gradients."},

      {SHARDKIT_CONFIG_FIELD(profile.every), at_least(0),
       "Profiler traces: every N steps, the last profile.active steps of each N are traced by "
       "LibTorch's profiler (Kineto where the build has it: CPU ops and, on CUDA, kernels and "
       "copies; else its legacy profiler: CPU ops), one Chrome trace per rank in "
       "profile.dir/step_<last step>/rank<r>.json; 0: off."},
      {SHARDKIT_CONFIG_FIELD(profile.active), at_least(1),
       "Steps each profiler trace covers (the last ones of each profile.every); at most "
       "profile.every."},
      {SHARDKIT_CONFIG_FIELD(profile.dir), any_value(),
       "Where profiler traces go; empty: run.dir/profile."},
      {SHARDKIT_CONFIG_FIELD(profile.memory_snapshot), any_value(),
       "CUDA memory snapshots: record the caching allocator's history (every allocation and free "
       "with its stack) from the start, and write what torch.cuda.memory._dump_snapshot writes "
       "(PyTorch's memory_viz opens it) to profile.dir/memory_snapshot/step_<N>/rank<r>.pickle at "
       "the end of each profile.every window (0: of the run), and to "
       "profile.dir/memory_snapshot/oom/rank<r>_step<N>.pickle on an out-of-memory error before the "
       "run exits. Needs train.device: cuda."},

      {SHARDKIT_CONFIG_FIELD(metrics.tensorboard), any_value(),
       "Rank 0 also writes TensorBoard event files to run.dir/tb: loss, lr, grad norm, tokens/s, "
       "MFU, memory, validation loss and each checkpoint's times, by step; a resumed run's file "
       "drops what earlier files logged from its first step on."},

      {SHARDKIT_CONFIG_FIELD(model.kind), one_of_at_run_time(models::model_kinds),
       "Model architecture: gpt, mlp, or llama (Llama 3: RMSNorm, RoPE, grouped-query "
       "attention, SwiGLU; Hugging Face parameter names), or a kind the program registered "
       "(models::register_model_spec)."},
      {SHARDKIT_CONFIG_FIELD(model.vocab_size), at_least(2), "Vocabulary size."},
      {SHARDKIT_CONFIG_FIELD(model.seq_len), at_least(1), "Context length in tokens."},
      {SHARDKIT_CONFIG_FIELD(model.d_model), at_least(1), "Hidden width."},
      {SHARDKIT_CONFIG_FIELD(model.n_layers), at_least(1), "Number of blocks."},
      {SHARDKIT_CONFIG_FIELD(model.n_heads), at_least(1),
       "Attention heads (gpt, llama); must divide model.d_model (llama: unless model.head_dim is "
       "set)."},
      {SHARDKIT_CONFIG_FIELD(model.n_kv_heads), at_least(0),
       "llama: key/value heads (grouped-query attention); must divide model.n_heads; 0: "
       "model.n_heads."},
      {SHARDKIT_CONFIG_FIELD(model.head_dim), at_least(0),
       "llama: each attention head's width (q_proj [n_heads * head_dim, d_model], k_proj and "
       "v_proj [n_kv_heads * head_dim, d_model], o_proj [d_model, n_heads * head_dim]; RoPE and "
       "q/k norm over it); must be even. 0: model.d_model / model.n_heads. Hugging Face's "
       "head_dim (Qwen3-30B-A3B: 128 with d_model 2048 and 32 heads)."},
      {SHARDKIT_CONFIG_FIELD(model.d_ff), at_least(0),
       "MLP inner width; 0: 4 * d_model (gpt, mlp), or 8/3 * d_model rounded up to a multiple "
       "of 256 (llama)."},
      {SHARDKIT_CONFIG_FIELD(model.tie_weights), any_value(),
       "Share the embedding and output projection weights; when not set: true for gpt and mlp, "
       "false for llama."},
      {SHARDKIT_CONFIG_FIELD(model.rope_theta), above(0), "llama: rotary embedding base."},
      {SHARDKIT_CONFIG_FIELD(model.norm_eps), above(0), "llama: RMSNorm epsilon."},
      {SHARDKIT_CONFIG_FIELD(model.rope_scaling.factor), at_least(0),
       "llama: Llama 3.1 rotary frequency scaling factor (Hugging Face rope_scaling, "
       "rope_type llama3); 0: off."},
      {SHARDKIT_CONFIG_FIELD(model.rope_scaling.low_freq_factor), above(0),
       "llama: rope_scaling low_freq_factor."},
      {SHARDKIT_CONFIG_FIELD(model.rope_scaling.high_freq_factor), above(0),
       "llama: rope_scaling high_freq_factor; must exceed low_freq_factor."},
      {SHARDKIT_CONFIG_FIELD(model.rope_scaling.original_max_position), at_least(1),
       "llama: rope_scaling original_max_position_embeddings."},
      {SHARDKIT_CONFIG_ENUM(model.activation_checkpointing, models::parse_activation_checkpointing), one_of_enum(models::kActivationCheckpointings),
       "Keep only a block's input for backward and recompute its forward there: none, full "
       "(every block), selective (every N-th block, N = "
       "model.activation_checkpointing_every)."},
      {SHARDKIT_CONFIG_FIELD(model.activation_checkpointing_every), at_least(1),
       "selective activation checkpointing: checkpoint blocks 0, N, 2N, ..."},
      {SHARDKIT_CONFIG_FIELD(model.lora.rank), at_least(0),
       "llama: LoRA adapters of this rank on the model.lora.targets projections of every block "
       "(y = x W^T + alpha/rank x A^T B^T, B zero at the start); every other parameter is "
       "frozen: no gradient, no optimizer state. 0: off (full fine-tuning)."},
      {SHARDKIT_CONFIG_FIELD(model.lora.alpha), above(0), "LoRA's alpha: the adapters' output is scaled by alpha / rank, as PEFT scales it."},
      {SHARDKIT_CONFIG_FIELD(model.lora.dropout), from_up_to_excl(0, 1), "Dropout on the adapters' input in training."},
      {SHARDKIT_CONFIG_FIELD(model.lora.base_dtype), one_of({"fp32", "bf16"}),
       "The frozen base's shards under LoRA: fp32, or bf16 (half their bytes; a bf16 Hugging Face "
       "base loads into them exactly). The adapters keep fp32 masters and AdamW state either way; "
       "the base is gathered in train.mixed_precision.param_dtype."},
      {SHARDKIT_CONFIG_FIELD(model.lora.targets), names_list(true),
       "The projections that get adapters, a YAML list or comma-separated: q_proj, k_proj, v_proj, "
       "o_proj, gate_proj, up_proj, down_proj (PEFT's target_modules)."},
      {SHARDKIT_CONFIG_FIELD(model.qk_norm), any_value(),
       "llama: an RMSNorm over each head's dimensions of q and of k before the rotary embedding "
       "(Qwen3's q_norm and k_norm)."},
      {SHARDKIT_CONFIG_FIELD(model.moe.num_experts), at_least(0),
       "llama: a mixture of this many routed SwiGLU experts in place of each block's MLP "
       "(docs/moe.md); 0: dense. Hugging Face num_experts / n_routed_experts."},
      {SHARDKIT_CONFIG_FIELD(model.moe.top_k), at_least(1),
       "Experts each token is routed to, at most model.moe.num_experts (num_experts_per_tok). "
       "Dropless: every token reaches all of them."},
      {SHARDKIT_CONFIG_FIELD(model.moe.d_ff), at_least(0),
       "Each expert's inner width (moe_intermediate_size); 0: model.d_ff's."},
      {SHARDKIT_CONFIG_ENUM(model.moe.score_func, models::parse_moe_score_func), one_of_enum(models::kMoeScoreFuncs),
       "The router's scores: softmax over the experts (Mixtral, Qwen3-MoE) or sigmoid of each "
       "(DeepSeek-V3)."},
      {SHARDKIT_CONFIG_FIELD(model.moe.route_norm), any_value(),
       "Renormalise each token's top-k weights to sum 1 (norm_topk_prob; Mixtral always does)."},
      {SHARDKIT_CONFIG_FIELD(model.moe.route_scale), above(0),
       "Factor on the routed experts' weights (routed_scaling_factor)."},
      {SHARDKIT_CONFIG_FIELD(model.moe.num_shared_experts), at_least(0),
       "Shared experts every token goes through, as one SwiGLU of width this times the expert "
       "width (n_shared_experts)."},
      {SHARDKIT_CONFIG_FIELD(model.moe.first_dense_layers), at_least(0),
       "The first this many blocks keep the dense MLP of width model.d_ff (first_k_dense_replace)."},
      {SHARDKIT_CONFIG_FIELD(model.moe.aux_loss_coef), at_least(0),
       "Weight of the load-balancing auxiliary loss, num_experts x sum over experts of (share of "
       "the top-k choices) x (mean router probability), per MoE block and averaged over them "
       "(router_aux_loss_coef); 0: off."},
      {SHARDKIT_CONFIG_FIELD(model.moe.load_balance_rate), at_least(0),
       "DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias on the scores, for the "
       "choice only, moved by this much after each step towards the mean load (its gamma; "
       "torchtitan's load_balance_coeff); 0: off."},
      {SHARDKIT_CONFIG_FIELD(model.init_from), any_value(),
       "Initialize model weights from a safetensors or torch.save file of full weights, a PyTorch "
       "DCP checkpoint, or a Hugging Face Llama, Qwen3-MoE or Mixtral directory (config.json gives the "
       "model keys; safetensors, sharded or not); ignored when resuming from a checkpoint, except by a LoRA run "
       "(model.lora.rank > 0), whose checkpoints hold the adapters: it reads its base from here again, and "
       "the base's weights must hash as the checkpoint recorded."},

      {SHARDKIT_CONFIG_ENUM(data.kind, data::parse_data_kind), one_of_enum(data::kDataKinds),
       "Dataset: synthetic tasks, a text file (its bytes, or the ids of data.tokenizer), "
       "pre-tokenized shards (llm.c .bin, Megatron .bin + .idx), or sft: instruction records "
       "(JSONL: prompt/completion, or messages in the Llama 3 chat format), the loss on the "
       "completion or assistant tokens only."},
      {SHARDKIT_CONFIG_ENUM(data.task, data::parse_synthetic_task), one_of_enum(data::kSyntheticTasks),
       "Synthetic task (data.kind synthetic)."},
      {SHARDKIT_CONFIG_FIELD(data.path), any_value(),
       "text: the text file; tokens: the shards, as a file, a directory of .bin files, a glob or "
       "a Megatron path prefix; sft: the JSONL file. Required for all three."},
      {SHARDKIT_CONFIG_FIELD(data.eval_fraction), from_up_to_excl(0, 0.5),
       "Held out for validation, never trained on: text: this fraction of the file (its tail); "
       "tokens: the trailing whole documents holding at least this fraction, or where that leaves "
       "no training tokens (one document, as a single llm.c shard) the last tokens of this fraction; "
       "synthetic: > 0 draws validation samples from a separate stream. 0: none."},
      {SHARDKIT_CONFIG_FIELD(data.eval_path), any_value(),
       "tokens: validation shards of their own (file, directory, glob or prefix); then "
       "data.eval_fraction is unused."},
      {SHARDKIT_CONFIG_FIELD(data.check_tokens), any_value(),
       "tokens: read every token once at start and refuse an id >= model.vocab_size, naming the "
       "file and offset; windows are checked as they are read either way."},
      {SHARDKIT_CONFIG_FIELD(data.tokenizer), any_value(),
       "A Hugging Face tokenizer.json (byte-level BPE), a SentencePiece .model, or bytes. text: "
       "the file is tokenized with it at start (empty: bytes, model.vocab_size 256); tokens: the "
       "tokenizer the shards were made with. train.sample_prompt, generate and ckpt export "
       "--format hf use it; sft: the records are tokenized with it at start (empty: bytes)."},
      {SHARDKIT_CONFIG_FIELD(data.packed), any_value(),
       "sft: pack whole records into each model.seq_len window (attention then crosses the "
       "records of a window, causally, as in torchtitan's packed pretraining); false: one record "
       "per window, padded, so no record attends to another."},

      {SHARDKIT_CONFIG_FIELD(optim.lr), above(0), "Peak learning rate, reached after warmup."},
      {SHARDKIT_CONFIG_FIELD(optim.min_lr), at_least(0),
       "Cosine floor at the last step; at most optim.lr."},
      {SHARDKIT_CONFIG_FIELD(optim.warmup_steps), at_least(0), "Linear warmup from 0."},
      {SHARDKIT_CONFIG_FIELD(optim.weight_decay), at_least(0), "AdamW decoupled weight decay."},
      {SHARDKIT_CONFIG_FIELD(optim.beta1), from_up_to_excl(0, 1), "AdamW first-moment decay."},
      {SHARDKIT_CONFIG_FIELD(optim.beta2), from_up_to_excl(0, 1), "AdamW second-moment decay."},
      {SHARDKIT_CONFIG_FIELD(optim.eps), above(0), "AdamW denominator epsilon."},

      {SHARDKIT_CONFIG_FIELD(parallel.replicate), minus_one_or_at_least(1),
       "Replicate degree of the mesh; -1: what the world size leaves. 1 with shard -1 is FSDP."},
      {SHARDKIT_CONFIG_FIELD(parallel.shard), minus_one_or_at_least(1),
       "Shard degree of the mesh; -1: what the world size leaves. 1 is DDP."},
      {SHARDKIT_CONFIG_FIELD(parallel.tensor), at_least(1),
       "Tensor-parallel degree: the innermost mesh axis (replicate x shard x tensor), so a TP "
       "group is consecutive ranks on one node. 1: none. Needs model.kind llama (or a "
       "UserModel with a plan); replicate x shard is then world / tensor."},
      {SHARDKIT_CONFIG_FIELD(parallel.expert), at_least(1),
       "Expert-parallel degree of a mixture of experts (docs/moe.md): its routed experts split over "
       "this many ranks of the shard axis, tokens sent to their experts and back by all-to-all; "
       "must divide parallel.shard and model.moe.num_experts. The experts' FSDP shards over the "
       "rest of the shard axis (shard / expert). 1: none."},
      {SHARDKIT_CONFIG_FIELD(parallel.context), at_least(1),
       "Context-parallel degree (docs/parallelism.md): each sequence split over this many "
       "consecutive ranks of the shard axis, which read the same samples and each take their part "
       "of the sequence (model.seq_len / parallel.context tokens); attention runs as a ring over "
       "them. Must divide parallel.shard; the batch splits over replicate x shard / context, and "
       "FSDP shards the parameters over the whole shard axis. Llama only, dense or a mixture of "
       "experts; combines with parallel.tensor (each rank's heads over the ring), "
       "parallel.pipeline and parallel.expert. 1: none."},
      {SHARDKIT_CONFIG_ENUM(parallel.context_load_balance, cp::parse_load_balance), one_of_enum(cp::kLoadBalances),
       "How a sequence splits over the context group: head_tail (2 x parallel.context equal "
       "chunks, rank r holding chunks r and 2C-1-r, so every rank has the same causal attention "
       "work) or none (parallel.context equal chunks in order). model.seq_len must split into "
       "that many equal chunks."},
      {SHARDKIT_CONFIG_FIELD(parallel.pipeline), at_least(1),
       "Pipeline-parallel degree: the outermost mesh axis (pipeline x replicate x shard x "
       "tensor). The model's blocks split into pipeline x parallel.stages_per_rank stages, "
       "the embedding with the first and the final norm, output and loss with the last; only "
       "activations and their gradients go between stages. 1: none. The other degrees then "
       "divide world / pipeline."},
      {SHARDKIT_CONFIG_ENUM(parallel.pipeline_schedule, pp::parse_schedule), one_of_enum(pp::kSchedules),
       "The pipeline's schedule over the step's micro-batches (train.micro_batch_size): gpipe "
       "(every forward, then every backward), 1f1b (one forward, one backward in turn: at most "
       "parallel.pipeline micro-batches' activations per stage; needs that many micro-batches), "
       "interleaved_1f1b (Megatron's, over parallel.stages_per_rank > 1 stages per rank; "
       "micro-batches a multiple of parallel.pipeline)."},
      {SHARDKIT_CONFIG_FIELD(parallel.stages_per_rank), at_least(1),
       "Stages each pipeline rank holds (stage s on rank s mod parallel.pipeline): above 1 "
       "only with interleaved_1f1b."},
      {SHARDKIT_CONFIG_FIELD(parallel.pipeline_split_points), names_list(false),
       "Where stages start, as torchtitan's pipeline_parallel_split_points: block names, a YAML "
       "list or comma-separated ([model.layers.4, model.layers.8]), each the first block of a "
       "stage after the first; empty: the blocks split evenly (the first stages one block larger)."},
      {SHARDKIT_CONFIG_FIELD(parallel.reshard_after_forward), any_value(),
       "Free gathered parameters after forward, gather again for backward."},
      {SHARDKIT_CONFIG_FIELD(parallel.prefetch), at_least(0),
       "Overlap: issue each unit's all-gather this many units ahead (forward order, reversed in "
       "backward) and keep as many gradient reductions in flight; 0: every collective waited "
       "for where it is issued. Losses are bit-identical either way."},

      {SHARDKIT_CONFIG_ENUM(dist.backend, comm::parse_backend), one_of_enum(comm::kBackends),
       "Process group backend; auto: nccl on cuda when built with NCCL, else gloo."},
      {SHARDKIT_CONFIG_FIELD(dist.timeout_s), above(0),
       "Collectives fail after this many seconds instead of hanging."},
      {SHARDKIT_CONFIG_FIELD(dist.stop_grace_s), at_least(0),
       "train --nproc: when a rank fails or the launcher is signalled, the other ranks get SIGTERM "
       "(a clean stop, saving where checkpoints are on) and SIGKILL after this many seconds."},
      {SHARDKIT_CONFIG_FIELD(dist.standby), any_value(),
       "train --nproc --max-restarts: keep one standby process per rank, loaded and waiting, "
       "which a restart activates as that rank instead of starting the program again (the "
       "restart skips the program's and LibTorch's load); false: restarted ranks start afresh."},
      {SHARDKIT_CONFIG_FIELD(dist.standby_delay_s), at_least(0),
       "dist.standby: the standbys start this many seconds after each attempt's ranks, so "
       "that they do not slow its start-up; a failure before then restarts ranks afresh."},
      {SHARDKIT_CONFIG_FIELD(dist.master_addr), any_value(),
       "Rendezvous address; empty: MASTER_ADDR, else 127.0.0.1."},
      {SHARDKIT_CONFIG_FIELD(dist.master_port), between(0, 65535),
       "Rendezvous port; 0: MASTER_PORT, else under SLURM 15000 + the last 4 digits of "
       "SLURM_JOB_ID, else 29500."},

      {SHARDKIT_CONFIG_FIELD(checkpoint.dir), any_value(),
       "Checkpoint directory; empty: <run.dir>/checkpoints."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.interval), auto_or_at_least(0),
       "Save every N steps and at the last; 0: off. auto: every sqrt(2 x save stall x "
       "checkpoint.mtbf_s) seconds of steps (Young/Daly), from the run's own measured save stall and "
       "step time: a first save after the process's second step measures the stall, and each later "
       "save derives the interval again; the banner and metrics.jsonl say each choice."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.mtbf_s), above(0),
       "checkpoint.interval auto: the job's mean time between failures, seconds (all its nodes "
       "together); ignored otherwise."},
      {SHARDKIT_CONFIG_ENUM(checkpoint.mode, checkpoint::parse_save_mode), one_of_enum(checkpoint::kSaveModes),
       "sync: block; async: stage to host then write in background; overlap: also stage in "
       "background."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.keep_last), at_least(0),
       "Keep the newest N committed checkpoints; 0: keep all."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.resume), non_empty(),
       "auto: newest committed checkpoint if any; never; or a checkpoint path."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.resume_fallback), any_value(),
       "resume auto: set a checkpoint that fails to load aside (renamed <step dir>.damaged) and "
       "try the next older one; false: fail."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.allow_config_change), any_value(),
       "resume even though the checkpoint was saved with other model, data, run.seed or "
       "train.global_batch_size values (they are listed); false: refuse to resume."},
      {SHARDKIT_CONFIG_ENUM(checkpoint.resume_audit, checkpoint::parse_resume_audit), one_of_enum(checkpoint::kResumeAudits),
       "Resume: hash the global batch the run trains on next and compare it with the one the "
       "checkpoint recorded when it was saved; on a difference, name what changed (a data file, "
       "the shards' order, run.seed, train.global_batch_size). error: exit 2; warn: say so and "
       "train on; off: no check. Checkpoints without the record resume with a note."},
      {SHARDKIT_CONFIG_ENUM(checkpoint.on_error, checkpoint::parse_on_error), one_of_enum(checkpoint::kOnErrors),
       "A failed save stops training (fail) or is logged (warn)."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.save_on_signal), any_value(),
       "SIGTERM triggers a final save before exit."},
      {SHARDKIT_CONFIG_ENUM(checkpoint.when_busy, checkpoint::parse_when_busy), one_of_enum(checkpoint::kWhenBusys),
       "When a save is due while the last one is still in flight."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.allow_partial), any_value(),
       "Load: tolerate missing or unexpected items."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.model_only), any_value(),
       "Load: model weights only, fresh optimizer and step 0."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.io_threads), between(1, 256),
       "Writer/reader threads per rank."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.plan_cache), any_value(),
       "Later saves of an unchanged state structure reuse the save plan (one small all-reduce "
       "checks every rank); false: plan every save in full."},
      {SHARDKIT_CONFIG_ENUM(checkpoint.direct_io, checkpoint::parse_direct_io), direct_io_values(),
       "Write large pieces of checkpoint files with O_DIRECT, bypassing the page cache, so "
       "saves do not evict the job's page cache. auto: at start, write 64 MiB into the "
       "checkpoint directory both ways (twice, with fsync) and use the faster one, as the "
       "banner says; a probe that fails means page cache. Then each save's data file of 64 MiB "
       "or more is timed: after the first, the next save tries the other way, and later saves "
       "take the way whose latest file wrote faster, measuring the slower way again after 16 "
       "such files (the interval doubles, up to 256, while it stays slower; a line says when "
       "the way changes). true: "
       "O_DIRECT (file systems that refuse it get page-cache writes). false: page cache."},
      {SHARDKIT_CONFIG_ENUM(checkpoint.device_snapshot, checkpoint::parse_device_snapshot), one_of_enum(checkpoint::kDeviceSnapshots),
       "Overlap mode with state on a GPU: copy the state into device memory first (as much "
       "again as the state, held for the run), so the optimizer never waits for the copy to the "
       "host; auto: when the GPU has that much free beyond 2 GiB at the first save; off: copy "
       "from the live state, and the optimizer step waits for the last chunk."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.local.dir), any_value(),
       "Node-local tier (/dev/shm, local NVMe) saves commit to first; {node} is replaced by the "
       "node's index, {run.dir} by run.dir; empty: one tier (checkpoint.dir)."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.local.keep_last), at_least(0),
       "Keep the newest N committed checkpoints in each node's local tier; 0: keep all."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.local.partner), any_value(),
       "Copy each rank's local files to a rank on the next node, so that losing one node leaves "
       "a complete local checkpoint (needs 2+ nodes with equal ranks)."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.durable.every), at_least(1),
       "With a local tier: flush every k-th local checkpoint (and the last) to checkpoint.dir "
       "in the background; 1: all."},
      {SHARDKIT_CONFIG_ENUM(checkpoint.compression.codec, checkpoint::parse_codec), one_of_enum(checkpoint::kCodecs),
       "Compression of tensor data."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.compression.level), between(1, 19), "zstd level."},
      {SHARDKIT_CONFIG_ENUM(checkpoint.compression.byte_group, checkpoint::parse_byte_group), one_of_enum(checkpoint::kByteGroups),
       "Group bytes by significance before compressing; auto: on for floats."},
      {SHARDKIT_CONFIG_FIELD(checkpoint.compression.block_size), between(4096, 1 << 30),
       "Bytes per independently coded block."},
  };
}

#undef SHARDKIT_CONFIG_FIELD
#undef SHARDKIT_CONFIG_ENUM

// Optimal string alignment distance: edits, with a swap of neighbours as one.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

std::string last_component(const std::string& path) {
  size_t dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

std::vector<std::string> all_paths() {
  std::vector<std::string> paths;
  for (const Key& key : schema()) {
    std::string path = key.path;
    for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1))
      if (std::find(paths.begin(), paths.end(), path.substr(0, dot)) == paths.end())
        paths.push_back(path.substr(0, dot));
    paths.push_back(path);
  }
  return paths;
}

// Shortest text that reads back as the same double, always with a '.' so
// that YAML 1.1 readers (PyYAML) also see a float: "1.0", "3.0e-04".
std::string format_double(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v);
  std::string text(buf, res.ptr);
  if (text.find_first_of(".ni") != std::string::npos) return text;  // has '.', or inf/nan
  size_t exponent = text.find('e');
  return exponent == std::string::npos ? text + ".0" : text.insert(exponent, ".0");
}

std::string format_bound(double v) {
  if (std::floor(v) == v && std::fabs(v) < 1e15) return std::to_string(static_cast<int64_t>(v));
  return format_double(v);
}

std::string describe_range(const Constraint& c) {
  std::string lo = c.min ? format_bound(*c.min) : "";
  std::string hi = c.max ? format_bound(*c.max) : "";
  std::string range;
  if (c.min && c.max && !c.min_open && !c.max_open) range = lo + ".." + hi;
  else if (c.min && c.max)
    range = "in " + std::string(c.min_open ? "(" : "[") + lo + ", " + hi + (c.max_open ? ")" : "]");
  else if (c.min) range = (c.min_open ? "> " : ">= ") + lo;
  else if (c.max) range = (c.max_open ? "< " : "<= ") + hi;
  if (c.also && !c.also_word) range = std::to_string(*c.also) + " or " + range;
  return range;
}

bool in_range(const Constraint& c, double v) {
  if (c.also && v == static_cast<double>(*c.also)) return !c.word_only;
  if (c.min && (c.min_open ? v <= *c.min : v < *c.min)) return false;
  if (c.max && (c.max_open ? v >= *c.max : v > *c.max)) return false;
  return true;
}

std::string quoted(const std::string& text) { return "\"" + text + "\""; }

// Leading '+' is valid YAML; from_chars does not take it.
std::string strip_plus(const std::string& text) {
  return !text.empty() && text[0] == '+' ? text.substr(1) : text;
}

std::optional<std::string> parse_int(const std::string& text, int64_t* out) {
  std::string digits = strip_plus(text);
  const char* end = digits.data() + digits.size();
  auto res = std::from_chars(digits.data(), end, *out);
  if (digits.empty() || res.ptr != end || res.ec == std::errc::invalid_argument)
    return "expected an integer, got " + quoted(text);
  if (res.ec == std::errc::result_out_of_range)
    return "expected an integer, got " + quoted(text) + " (out of range)";
  return std::nullopt;
}

std::optional<std::string> parse_float(const std::string& text, double* out) {
  std::string digits = strip_plus(text);
  const char* end = digits.data() + digits.size();
  auto res = std::from_chars(digits.data(), end, *out);
  if (digits.empty() || res.ptr != end || res.ec != std::errc() || !std::isfinite(*out))
    return "expected a number, got " + quoted(text);
  return std::nullopt;
}

std::optional<std::string> parse_bool(const std::string& text, bool* out) {
  if (text == "true" || text == "True" || text == "TRUE") *out = true;
  else if (text == "false" || text == "False" || text == "FALSE") *out = false;
  else return "expected true or false, got " + quoted(text);
  return std::nullopt;
}

std::optional<std::string> check_constraint(const Key& key, const Value& value) {
  const Constraint& c = key.constraint;
  if (key.type == ValueType::kString) {
    const std::string& s = std::get<std::string>(value);
    const std::vector<std::string> choices = c.choices_of ? c.choices_of() : c.choices;
    const bool also = std::find(c.also_accepted.begin(), c.also_accepted.end(), s) != c.also_accepted.end();
    if (!choices.empty() && !also && std::find(choices.begin(), choices.end(), s) == choices.end())
      return "expected " + describe_expected(key) + ", got " + quoted(s);
    if (c.non_empty && s.empty()) return "expected " + describe_expected(key) + ", got \"\"";
    return std::nullopt;
  }
  double v = 0;
  if (key.type == ValueType::kInt) v = static_cast<double>(std::get<int64_t>(value));
  else if (key.type == ValueType::kFloat) v = std::get<double>(value);
  else return std::nullopt;
  if (!in_range(c, v)) return "expected " + describe_expected(key) + ", got " + format_value(value);
  return std::nullopt;
}

}  // namespace

Constraint any_value() { return Constraint{}; }

Constraint non_empty() {
  Constraint c;
  c.non_empty = true;
  return c;
}

Constraint names_list(bool non_empty) {
  Constraint c;
  c.non_empty = non_empty;
  c.list = true;
  return c;
}

Constraint one_of(std::vector<std::string> choices) {
  Constraint c;
  c.choices = std::move(choices);
  return c;
}

Constraint one_of_at_run_time(std::vector<std::string> (*choices_of)()) {
  Constraint c;
  c.choices_of = choices_of;
  return c;
}

Constraint at_least(double min) {
  Constraint c;
  c.min = min;
  return c;
}

Constraint auto_or_above(double min) {
  Constraint c = above(min);
  c.also = 0;
  c.also_word = "auto";
  return c;
}

Constraint auto_or_at_least(double min) {
  Constraint c = at_least(min);
  c.also = -1;
  c.also_word = "auto";
  c.word_only = true;
  return c;
}

Constraint above(double min) {
  Constraint c = at_least(min);
  c.min_open = true;
  return c;
}

Constraint between(double min, double max) {
  Constraint c = at_least(min);
  c.max = max;
  return c;
}

Constraint from_up_to_excl(double min, double max) {
  Constraint c = between(min, max);
  c.max_open = true;
  return c;
}

Constraint minus_one_or_at_least(double min) {
  Constraint c = at_least(min);
  c.also = -1;
  return c;
}

const std::vector<Key>& schema() {
  static const std::vector<Key> keys = build_schema();
  return keys;
}

const Key* find_key(const std::string& path) {
  for (const Key& key : schema())
    if (path == key.path) return &key;
  return nullptr;
}

bool is_section(const std::string& path) {
  for (const Key& key : schema()) {
    std::string k = key.path;
    if (k.size() > path.size() && k.compare(0, path.size(), path) == 0 && k[path.size()] == '.')
      return true;
  }
  return false;
}

std::string closest_path(const std::string& path) {
  // A known key name under the wrong section ("train.seed") is a likely slip.
  std::string name = last_component(path);
  std::string same_name;
  int same_name_count = 0;
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const std::string& candidate : all_paths()) {
    if (last_component(candidate) == name) {
      same_name = candidate;
      ++same_name_count;
    }
    size_t d = edit_distance(path, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  // Two edits for short names ("lvl" -> "level"), three for long ones; one
  // for names of one or two letters, where two edits could reach anything.
  size_t allowed = name.size() <= 2 ? 1 : name.size() < 9 ? 2 : 3;
  if (best_distance <= allowed) return best;
  if (same_name_count == 1) return same_name;
  return "";
}

std::optional<std::string> parse_value(const Key& key, const std::string& text, bool is_null,
                                       Value* out) {
  if (is_null && key.type != ValueType::kString)
    return "expected " + describe_expected(key) + ", got an empty value";
  std::optional<std::string> problem;
  const Constraint& c = key.constraint;
  if (c.also && c.also_word && text == c.also_word) {
    if (key.type == ValueType::kInt) *out = *c.also;
    if (key.type == ValueType::kFloat) *out = static_cast<double>(*c.also);
    return std::nullopt;
  }
  switch (key.type) {
    case ValueType::kInt: {
      int64_t v = 0;
      problem = parse_int(text, &v);
      *out = v;
      break;
    }
    case ValueType::kFloat: {
      double v = 0;
      problem = parse_float(text, &v);
      *out = v;
      break;
    }
    case ValueType::kBool: {
      bool v = false;
      problem = parse_bool(text, &v);
      *out = v;
      break;
    }
    case ValueType::kString:
      *out = is_null ? std::string() : text;
      break;
  }
  if (problem && c.also_word) return "expected " + describe_expected(key) + ", got " + quoted(text);
  if (problem) return problem;
  return check_constraint(key, *out);
}

std::string describe_expected(const Key& key) {
  const Constraint& c = key.constraint;
  std::string range = describe_range(c);
  std::string suffix = range.empty() ? "" : " " + range;
  switch (key.type) {
    case ValueType::kInt: return (c.also_word ? c.also_word + std::string(" or ") : "") + "an integer" + suffix;
    case ValueType::kFloat: return (c.also_word ? c.also_word + std::string(" or ") : "") + "a number" + suffix;
    case ValueType::kBool: return "true or false";
    case ValueType::kString: break;
  }
  const std::vector<std::string> choices = c.choices_of ? c.choices_of() : c.choices;
  if (!choices.empty()) {
    std::string joined;
    for (const std::string& choice : choices) joined += (joined.empty() ? "" : "|") + choice;
    return "one of " + joined;
  }
  if (c.list) return c.non_empty ? "names, comma-separated or a YAML list" : "names (comma-separated or a YAML list) or \"\"";
  return c.non_empty ? "a non-empty string" : "a string";
}

std::string format_value(const Value& value) {
  if (auto* i = std::get_if<int64_t>(&value)) return std::to_string(*i);
  if (auto* d = std::get_if<double>(&value)) return format_double(*d);
  if (auto* b = std::get_if<bool>(&value)) return *b ? "true" : "false";
  std::string out = "\"";
  for (unsigned char ch : std::get<std::string>(value)) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += static_cast<char>(ch);
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (ch < 0x20 || ch == 0x7f) {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[ch >> 4];
      out += kHex[ch & 15];
    } else {
      out += static_cast<char>(ch);
    }
  }
  return out + "\"";
}

std::string format_key_value(const Key& key, const Value& value) {
  const Constraint& c = key.constraint;
  const int64_t* i = std::get_if<int64_t>(&value);
  if (c.word_only && c.also && c.also_word && i != nullptr && *i == *c.also) return c.also_word;
  return format_value(value);
}

}  // namespace framework::config
