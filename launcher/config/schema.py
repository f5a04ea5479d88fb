"""Typed schema of the config tree (the YAML files in conf/ hold the values, this holds the types).

Each key is one line here: its type, its default, what it allows and what it means
(`knob(default, check, doc)`, launcher.config.fields); launcher.config.ranges runs every field's
check, launcher.config.validate the rules that tie fields, sections and files together, and
`python -m launcher --help SECTION` prints the keys from here. `typed(cfg)` merges a composed
DictConfig into these dataclasses, so a wrong type (`grpo.max_num_steps=abc`) or a misspelt key
becomes a ConfigError naming the key. Workers receive the plain sections they need
(`OmegaConf.to_container(cfg.peft)`), not this module.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from launcher import metric_names as names
from launcher.config import fields
from launcher.config.fields import All, Elsewhere, Filled, Free, OneOf, Range, Text, knob, section


# Ray custom resources of the placement (launcher.plan): a node offers one unit per trainer rank /
# vLLM worker it hosts; actors ask for them (workers may not import launcher.plan, so they live here).
TRAIN_SLOT = "train_slot"
GENERATION_SLOT = "generation_slot"


class ConfigError(Exception):
    """A user mistake in the config: one line naming the key and what is allowed."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


# The checkers' shared shapes: counts of nodes and engines, parallel sizes (at least 1, a size bound), ports
COUNT = All((Range(1, None), Range(None, 4096)))
PARALLEL = All((Range(1, None), Range(None, 1024)))
PORT = Range(1024, 65535)
# a duration the job turns into a datetime.timedelta, a socket timeout or torch's C++ timeouts: a week at
# most (timedelta(seconds=1e20) overflows; tests/unit/test_job_limits.py walks every *_s field)
MAX_SECONDS = 7 * 86400
# vLLM raises a sampling temperature under this to it (vllm.sampling_params._MAX_TEMP) while the trainer
# divides the logits by the temperature it was given: below it the two would compute different distributions
VLLM_MIN_TEMPERATURE = 0.01
DTYPES = ("float32", "bfloat16", "float16")
LORA_INITS = ("xavier", "uniform", "normal", "zero", "kaiming")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
JOBS = ("grpo", "placement_smoke", "hold", "preflight")
# What vLLM 0.32 accepts for the engine settings of topology.generation (tests/unit/test_job_limits.py reads them
# off the installed vLLM: KernelConfig's MoEBackend, CacheConfig's MambaDType, CompilationConfig's CUDAGraphMode,
# AttentionBackendEnum)
VLLM_MOE_BACKENDS = ("auto", "triton", "batched_triton", "deep_gemm", "deep_gemm_mega_moe", "cutlass",
                     "flashinfer_trtllm", "flashinfer_cutlass", "flashinfer_cutedsl", "flashinfer_moe_ep_cutedsl",
                     "flashinfer_b12x", "b12x", "flashinfer_moe_ep_mega_deep_gemm", "marlin", "humming",
                     "triton_unfused", "aiter", "aiter_mega_moe", "aiter_triton_mxfp4_bf16", "flydsl", "hpc",
                     "emulation", "rdna3")
VLLM_MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")
VLLM_CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
VLLM_ATTENTION_BACKENDS = (
    "FLASH_ATTN", "FLASH_ATTN_DIFFKV", "TRITON_ATTN", "TRITON_ATTN_DIFFKV", "TRITON_FLASH_ATTN", "ROCM_ATTN",
    "ROCM_SEGMENTED_ATTN", "ROCM_AITER_MLA", "ROCM_AITER_TRITON_MLA", "ROCM_AITER_FA", "ROCM_AITER_MLA_SPARSE",
    "XPU_MLA_SPARSE", "TORCH_SDPA", "FLASHINFER", "TRITON_FLASHINFER", "FLASHINFER_MLA", "TOKENSPEED_MLA",
    "FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120", "FLASHINFER_MLA_SPARSE_SM90", "TRITON_MLA", "CUTLASS_MLA",
    "FLASHMLA", "FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4", "ROCM_FLASHMLA_SPARSE_DSV4",
    "FLASHMLA_SPARSE_DSV41", "FLASHINFER_MLA_SPARSE_DSV41", "FLASHMLA_MEGA_ATTN_DSV41", "B12X", "FLASH_ATTN_MLA",
    "FLASH_ATTN_MLA_SPARSE", "MINIMAX_M3_SPARSE", "CUTLASS_MSA", "TRITON_MSA", "NO_ATTENTION", "FLEX_ATTENTION",
    "HPC_ATTN", "ROCM_AITER_UNIFIED_ATTN", "CPU_ATTN", "CPU_MLA", "AMX_MLA", "TURBOQUANT", "ULTRAQUANT", "CUSTOM")


# Activation recompute (topology.train.recompute): none | selective | full. selective recomputes the
# modules of Megatron-Bridge's Nemotron 3 Ultra LoRA recipe (megatron-core's recompute_modules:
# moe and shared_experts checkpoint the MoE layer and its shared expert, mlp a dense MLP, moe_act
# the experts' activation, layernorm the norms, core_attn the attention core); full recomputes
# every layer from its input (recompute_method uniform, one layer per unit). The trainer
# (workers.trainer.provider_settings) and the memory plan (launcher.memory) read these.
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_MODULES = ("moe", "moe_act", "mlp", "shared_experts", "layernorm", "core_attn")


def selective_modules(grouped_gemm: bool = True) -> tuple[str, ...]:
    """What `recompute: selective` recomputes: moe_act only with grouped-GEMM experts (megatron-core
    refuses it otherwise), which a CUDA node with Transformer Engine has (the memory plan assumes it)."""
    return tuple(m for m in RECOMPUTE_MODULES if m != "moe_act" or grouped_gemm)

# megatron-core's AttnBackend names; fused is the Bridge's Nemotron 3 recipes' choice (Transformer
# Engine's cuDNN attention), flash needs the flash-attn package, local is megatron's own attention
ATTENTION_BACKENDS = ("fused", "flash", "unfused", "local", "auto")


@dataclass
class TrainRole:
    nodes: int = knob(1, COUNT, "nodes that host trainer ranks")
    ranks_per_node: int = knob(1, PARALLEL, "trainer processes per node (one per GPU on cuda)")
    tensor_parallel: int = knob(1, PARALLEL, "Megatron tensor parallel size (TP)")
    pipeline_parallel: int = knob(1, PARALLEL, "Megatron pipeline parallel size (PP)")
    context_parallel: int = knob(1, PARALLEL, "context parallel size; the trainer does not split sequences yet: 1")
    expert_parallel: int = knob(1, PARALLEL, "expert parallel size (EP) of an MoE model; 1 for a dense one")
    expert_tensor_parallel: int = knob(1, PARALLEL, "tensor parallel size inside the experts (ETP)")
    sequence_parallel: bool = knob(False, None, "Megatron sequence parallelism (needs tensor_parallel > 1)")
    micro_batch_size: int = knob(0, Range(0, 1 << 16), "sequences per forward/backward pass of a trainer rank; "
                                                       "0: its whole shard at once")
    recompute: str = knob("none", OneOf(RECOMPUTE), "activation recompute: none | selective (recompute "
                                                    f"{', '.join(RECOMPUTE_MODULES)}: the Bridge's Nemotron 3 Ultra "
                                                    "LoRA recipe) | full (every layer from its input)")
    attention_backend: str = knob("fused", OneOf(ATTENTION_BACKENDS),
                                  "Megatron's attention on cuda with Transformer Engine (fused: cuDNN, the Bridge's "
                                  "recipes; flash: needs flash-attn); without TE and on cpu: local")
    mamba_ssm_states_dtype: str = knob("auto", OneOf(("auto",) + DTYPES),
                                       "a hybrid's inter-chunk SSM states in training (megatron's "
                                       "mamba_training_ssm_states_dtype); auto: the dtype vLLM keeps them in "
                                       "(topology.generation.mamba_ssm_cache_dtype, else config.json's, float32 for "
                                       "Nemotron-H), so both sides run the recurrence alike")


@dataclass
class GenerationRole:
    nodes: int = knob(1, COUNT, "nodes that host vLLM workers")
    ranks_per_node: int = knob(1, PARALLEL, "vLLM workers per node (one per GPU on cuda)")
    engines: int = knob(1, COUNT, "vLLM engines; engines x tensor_parallel = the vLLM workers")
    tensor_parallel: int = knob(1, PARALLEL, "vLLM tensor parallel size of one engine (1 on cpu)")
    # the engines' kernels, graphs and caches on this topology's GPUs (vllm.LLM's keyword arguments; null / auto:
    # vLLM's own choice). NeMo RL's Ultra recipes pin them: conf/topology/ultra_6n4g.yaml
    attention_backend: Optional[str] = knob(None, OneOf(VLLM_ATTENTION_BACKENDS, nullable=True),
                                            "cuda only: vLLM's attention backend (FLASH_ATTN, FLASHINFER, ...)")
    moe_backend: str = knob("auto", OneOf(VLLM_MOE_BACKENDS), "cuda only: vLLM's MoE expert kernels (on SM100 its "
                                                              "auto picks FlashInfer-TRTLLM first)")
    cudagraph_mode: Optional[str] = knob(None, OneOf(VLLM_CUDAGRAPH_MODES, nullable=True),
                                         "cuda only, with CUDA graphs (vllm.enforce_eager): what vLLM captures")
    cudagraph_capture_sizes: Optional[list[int]] = knob(None, fields.Sizes(),
                                                        "cuda only: the batch sizes vLLM captures graphs of")
    fuse_allreduce_rms: Optional[bool] = knob(None, OneOf((True, False), nullable=True), "cuda only: vLLM's all-reduce + RMSNorm fusion "
                                                          "(FlashInfer); false when TP spans nodes")
    max_num_seqs: Optional[int] = knob(None, Range(1, None, nullable=True),
                                       "sequences one engine step runs at most (a hybrid's Mamba state slots)")
    mamba_ssm_cache_dtype: str = knob("auto", OneOf(VLLM_MAMBA_DTYPES),
                                      "a hybrid's SSM state in vLLM's cache; auto: config.json's mamba_ssm_cache_dtype")


@dataclass
class Topology:
    name: str = knob("local", Text(nullable=False), "the topology's name (conf/topology/<name>.yaml)")
    executor: str = knob("local", OneOf(("local", "slurm"), say="must be local or slurm, got {value!r}"),
                         "local: this machine, in this process; slurm: one sbatch job")
    device: str = knob("cpu", OneOf(("cpu", "cuda"), say="must be cpu or cuda, got {value!r}"),
                       "what the trainers and vLLM run on")
    nodes: int = knob(1, COUNT, "nodes of the job: train.nodes + generation.nodes (1 for the local executor)")
    gpus_per_node: int = knob(0, Range(0, 1024), "GPUs (Slurm GRES) requested per node; 0: none")
    cpus_per_node: Optional[int] = knob(None, Range(1, 65536, nullable=True),
                                        "cores per node: --cpus-per-task of the job and of its srun step (one task "
                                        "per node); null: Slurm's default (one)")
    colocate_roles: bool = knob(False, None, "both roles on one node (nodes = train.nodes = generation.nodes = 1)")
    gpu_memory_gib: float = knob(184.0, Range(1, None), "memory per GPU for the memory plan (launcher.memory); "
                                                        "GB200: 186 GB, CUDA reports ~185 GiB")
    interconnect_gb_s: float = knob(900.0, Range(0, None, lo_open=True),
                                    "GB/s (1e9 bytes/s) from trainer rank 0 to the vLLM workers, for the dry run's "
                                    "refit estimate (launcher.refit_cost); GB200 NVL72: 900 (NVLink 5 per GPU and "
                                    "direction, nodes in one NVLink domain); 50 over a 400 Gb/s InfiniBand NIC")
    nvlink_domain_nodes: Optional[int] = knob(None, Range(1, 4096, nullable=True),
                                              "nodes that must share one NVLink domain: sbatch --segment (a divisor "
                                              "of nodes, job.sbatch.job_spec), NCCL_MNNVL_ENABLE=1 when above 1; "
                                              "null: no NVLink domain across nodes")
    train: TrainRole = section(TrainRole, "the Megatron trainers' nodes and parallel layout")
    generation: GenerationRole = section(GenerationRole, "the vLLM generators' nodes and engines")



# Model families (HF model_type) and the Megatron module paths inside decoder.layers.N that LoRA
# may wrap in each. The Megatron-Bridge class of a family lives in workers.lora.layout.
LORA_MODULES: dict[str, tuple[str, ...]] = {
    "llama": ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"),
    "qwen2": ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"),
    "qwen3": ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"),
    # MoE: the experts' fc1/fc2, grouped (TE) or one module per local expert (* = any expert number)
    "qwen3_moe": ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.experts.linear_fc1",
                  "mlp.experts.linear_fc2", "mlp.experts.local_experts.*.linear_fc1",
                  "mlp.experts.local_experts.*.linear_fc2"),
    # hybrid: attention (* layers), MLP (-), Mamba-2 in/out projections (M), routed and shared experts (E)
    "nemotron_h": ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2",
                   "mixer.in_proj", "mixer.out_proj", "mlp.experts.linear_fc1", "mlp.experts.linear_fc2",
                   "mlp.experts.local_experts.*.linear_fc1", "mlp.experts.local_experts.*.linear_fc2",
                   "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"),
}
FAMILIES = tuple(LORA_MODULES)

# LoRA modules an HF PEFT adapter cannot hold, per family, and why: the adapter exporter and
# refit.mode=adapter (which serves a PEFT adapter) refuse them; the merged refit modes take them.
LORA_NOT_IN_PEFT: dict[str, dict[str, str]] = {
    "nemotron_h": {"mixer.out_proj": "PEFT refuses LoRA on a Mamba layer's out_proj for nemotron_h "
                                     "(peft.tuners.tuners_utils._check_lora_target_modules_mamba)"},
}

# Built-in models (`model.builtin`, used when model.path is null): architecture numbers per recipe,
# built locally with random weights by workers.tiny_models. heads * head_dim need not equal hidden
# (it does not for Nemotron-H), and the exporter tests rely on recipes where it does not.
# what every built-in recipe has besides its own numbers (workers.tiny_models builds with these)
BUILTIN_COMMON: dict = dict(max_position_embeddings=1024, tie_word_embeddings=False, rope_theta=10000.0)
BUILTIN_MODELS: dict[str, dict] = {
    # the default model: Llama-style GQA, 4 query heads in 2 groups, head_dim 32
    "tiny_llama": dict(family="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # Qwen2 style: q/k/v biases
    "tiny_qwen2": dict(family="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # about 100M parameters, for the refit benchmark
    "llama_100m": dict(family="llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=4, head_dim=64, vocab_size=4096),
    # Nemotron-H family (transformers' NemotronHForCausalLM): M = Mamba-2, * = attention, - = MLP,
    # E = MoE (4 routed relu2 experts, top-2, sigmoid router with an expert bias, + 1 shared expert).
    # Mamba: 8 heads x 16 in 2 groups, state 16, chunk 16 (TP2 and EP2 divide them all)
    "tiny_nemotron_h": dict(family="nemotron_h", hidden_size=128, intermediate_size=256,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                            hybrid_override_pattern="M*EM*-", mamba_num_heads=8, mamba_head_dim=16,
                            ssm_state_size=16, n_groups=2, chunk_size=16, n_routed_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=64,
                            moe_shared_expert_intermediate_size=64, n_shared_experts=1),
    # the same without MoE layers
    "tiny_nemotron_h_dense": dict(family="nemotron_h", hidden_size=128, intermediate_size=256,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                                  hybrid_override_pattern="M*-M*-", mamba_num_heads=8, mamba_head_dim=16,
                                  ssm_state_size=16, n_groups=2, chunk_size=16),
    # Nemotron 3 as released (Super/Ultra): Ultra-style layers M E M * E (Mamba-2 and MoE alternating,
    # attention before the last MoE); LatentMoE: 16 routed relu2 experts, top-4, computing in a latent width
    # of 32 (a quarter of hidden, as published) between fc1_latent_proj and fc2_latent_proj, a sigmoid router
    # with an expert bias and a routing scale, + 1 shared expert at full width; one MTP step of an attention
    # and an MoE layer (mtp.layers.*, as published). 8 attention heads of 32 in 2 KV groups; Mamba: 8 heads
    # x 16 in 2 groups, state 16, chunk 16. TP2, EP2 and ultra_6n4g's TP2 / EP16 / TP8 engine divide it.
    "tiny_nemotron3": dict(family="nemotron_h", hidden_size=128, intermediate_size=256, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=32, hybrid_override_pattern="MEM*E",
                           mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
                           n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, moe_latent_size=32,
                           moe_shared_expert_intermediate_size=128, n_shared_experts=1, routed_scaling_factor=2.5,
                           num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E"),
    # Qwen3: q/k RMSNorm per head
    "tiny_qwen3": dict(family="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # Qwen3-MoE: 4 experts, top-2, on every layer (EP2 puts 2 on each rank), top-k probabilities
    # renormalised as the published checkpoints; head_dim 32 for vLLM CPU
    "tiny_qwen3_moe": dict(family="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
    # the default model with a ChatML tokenizer and chat template (env=guess_number: an environment's
    # messages are rendered with the chat template)
    "tiny_llama_chat": dict(family="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}
CHAT_RECIPES = ("tiny_llama_chat",)   # built with workers.tiny_models.make_tokenizer(chat=True)


@dataclass
class ParameterCounts:
    """`model.size`: what the memory plan (launcher.memory) reads when the checkpoint is not on this
    machine (a dry run for a cluster); with model.path here its safetensors headers say it all."""

    parameters: Optional[int] = knob(None, Range(1, None, nullable=True), "every weight of the model")
    expert_parameters: Optional[int] = knob(None, Range(0, None, nullable=True), "of which routed experts")
    moe_layers: Optional[int] = knob(None, Range(1, 100_000, nullable=True),
                                     "layers with routed experts; null: the layer pattern's MoE layers, else "
                                     "num_layers when there are experts")
    attention_layers: Optional[int] = knob(None, Range(0, 100_000, nullable=True),
                                           "layers with a KV cache; null: the layer pattern's attention layers, "
                                           "else num_layers")
    vocab_size: Optional[int] = knob(None, Range(1, 100_000_000, nullable=True),
                                     "the embedding's rows: the logits' width in the trainer's activations; null: "
                                     "the logits are not counted")


# the model's facts (launcher.config.model_facts): null where a dry run could not read the checkpoint
FACT = "a fact of the model, resolved from config.json or the built-in recipe"
YES_NO = OneOf((True, False), nullable=True)


@dataclass
class Model:
    """`model:`. The facts (family .. family_facts) are resolved once, at composition, from
    model.path's config.json or the built-in recipe (launcher.config.model_facts), and the run's
    config.yaml holds them; a value stated in conf/ or on the command line serves only a dry run
    for a checkpoint that is not on this machine (it is noted and replaced where one is)."""

    name: str = knob("tiny_llama", Text(nullable=False), "the model's name; with model.path: the checkpoint "
                                                         "directory's name")
    path: Optional[str] = knob(None, Elsewhere("paths.path_error, validate._model_dir", "a HF checkpoint directory "
                                               "(config.json, safetensors, tokenizer) or null"),
                               "the Hugging Face checkpoint to train; null: the built-in recipe model.builtin")
    builtin: Optional[str] = knob(None, Elsewhere("validate._model", "a built-in recipe when model.path is null"),
                                  "the built-in recipe built with random weights (workers.tiny_models)")
    dtype: str = knob("float32", OneOf(DTYPES), "the weights' dtype in the trainers")
    family: Optional[str] = knob(None, Elsewhere("validate._model", "a family Megatron-Bridge and the LoRA "
                                                 "layout know"), "HF model_type (llama, qwen3_moe, nemotron_h, ...)")
    num_layers: Optional[int] = knob(None, Range(1, 100_000, nullable=True), f"decoder layers; {FACT}")
    hidden_size: Optional[int] = knob(None, Range(1, 1_000_000, nullable=True), f"hidden width; {FACT}")
    num_attention_heads: Optional[int] = knob(None, Range(1, 100_000, nullable=True), f"query heads; {FACT}")
    num_query_groups: Optional[int] = knob(None, Range(1, 100_000, nullable=True),
                                           f"key/value heads (GQA groups); {FACT}")
    head_dim: Optional[int] = knob(None, Range(1, 100_000, nullable=True), f"width of one head; {FACT}")
    num_experts: Optional[int] = knob(None, Range(0, 100_000, nullable=True), f"routed experts (0: dense); {FACT}")
    moe_router_topk: Optional[int] = knob(None, Range(0, 100_000, nullable=True),
                                          f"experts per token (0: dense); {FACT}")
    ffn_hidden_size: Optional[int] = knob(None, Range(0, 10_000_000, nullable=True), f"MLP width; {FACT}")
    moe_ffn_hidden_size: Optional[int] = knob(None, Range(0, 10_000_000, nullable=True),
                                              f"one expert's MLP width; {FACT}")
    tie_word_embeddings: Optional[bool] = knob(None, YES_NO, f"output layer shares the embedding; {FACT}")
    qkv_bias: Optional[bool] = knob(None, YES_NO, f"biases on q/k/v (Qwen2); {FACT}")
    qk_norm: Optional[bool] = knob(None, YES_NO, f"RMSNorm of q and k per head (Qwen3); {FACT}")
    rope_theta: Optional[float] = knob(None, Range(0, None, lo_open=True, nullable=True), f"RoPE base; {FACT}")
    rope_scaling: dict[str, Any] = knob({}, Elsewhere("model_rules.errors", "a RoPE scaling the trainer and vLLM "
                                                      "both apply"), f"RoPE scaling ({{}}: plain RoPE); {FACT}")
    max_position_embeddings: Optional[int] = knob(None, Range(1, None, nullable=True),
                                                  f"longest sequence the model was built for; {FACT}")
    family_facts: dict[str, Any] = knob({}, Elsewhere("model_rules.errors", "facts of the family the stack "
                                                      "supports"), f"facts only a family has (Mamba heads, ...); {FACT}")
    facts_from: Optional[str] = knob(None, Free("where the facts came from, written by launcher.config.model_facts"),
                                     "<model.path>/config.json | builtin:<recipe> | null: not resolved")
    size: ParameterCounts = section(ParameterCounts, "not a fact: the memory plan's parameter counts")


PEFT_ON = "enabled"


@dataclass
class Peft:
    enabled: bool = knob(True, None, "train LoRA adapters (false: full fine-tuning, conf/peft/none.yaml)")
    target_modules: list[str] = knob(["linear_qkv", "linear_proj"],
                                     Filled(say="is empty: name at least one module, e.g. [linear_qkv]"),
                                     "modules LoRA wraps: a Megatron name (linear_qkv) or a pattern "
                                     "(decoder.layers.*.mlp.linear_fc1); validate checks they exist", when=PEFT_ON)
    dim: int = knob(16, Range(1, None, say="LoRA rank must be at least 1, got {value}"), "LoRA rank", when=PEFT_ON)
    alpha: float = knob(32, Range(0, None, lo_open=True, say="must be positive, got {value}"),
                        "LoRA alpha: the adapter's output is scaled by alpha / dim", when=PEFT_ON)
    dropout: float = knob(0.0, Range(0, 1, hi_open=True), "dropout on the LoRA path", when=PEFT_ON)
    dropout_position: str = knob("post", OneOf(("pre", "post"), say="must be pre or post, got {value!r}"),
                                 "dropout before the adapter's A or after its B (Megatron-Bridge)", when=PEFT_ON)
    lora_A_init_method: str = knob("xavier", OneOf(LORA_INITS), "initialisation of LoRA's A", when=PEFT_ON)
    lora_B_init_method: str = knob("zero", OneOf(LORA_INITS), "initialisation of LoRA's B (zero: the adapter "
                                                              "starts as the identity)", when=PEFT_ON)
    lora_dtype: Optional[str] = knob(None, OneOf(DTYPES, nullable=True, say="must be null or one of "
                                                 f"{', '.join(DTYPES)}, got {{value!r}}"),
                                     "dtype of the LoRA weights; null: the model's", when=PEFT_ON)
    freeze_moe_router: bool = knob(False, None, "keep an MoE router's weights fixed (full fine-tuning)")


@dataclass
class RewardScaling:
    enabled: bool = knob(True, None, "map scores linearly from [source_min, source_max] to [target_min, target_max]")
    source_min: float = knob(0.0, Elsewhere("ranges._cross", "below source_max"), "the lowest score reward.fn gives")
    source_max: float = knob(1.0, Elsewhere("ranges._cross", "above source_min"), "the highest score reward.fn gives")
    target_min: float = knob(-1.0, Elsewhere("ranges._cross", "below target_max"), "what source_min becomes")
    target_max: float = knob(1.0, Elsewhere("ranges._cross", "above target_min"), "what source_max becomes")


LOSS_RULE = "schema.loss_errors (the trainer checks it too)"


@dataclass
class Loss:
    ratio_clip_min: float = knob(0.2, Elsewhere(LOSS_RULE, ">= 0"), "PPO clip: the ratio is kept above 1 - this")
    ratio_clip_max: float = knob(0.28, Elsewhere(LOSS_RULE, ">= 0"), "PPO clip: the ratio is kept below 1 + this "
                                                                     "(DAPO's clip-higher when above ratio_clip_min)")
    ratio_clip_c: Optional[float] = knob(10.0, Elsewhere(LOSS_RULE, "> 1 or null"),
                                         "dual clip of negative advantages' ratio; null: off")
    reference_policy_kl_penalty: float = knob(0.0, Range(0, None), "weight of the k3 KL to the reference policy "
                                                                   "(the base model without LoRA); 0: off")
    kl_input_clamp_value: Optional[float] = knob(20.0, Elsewhere(LOSS_RULE, "> 0 or null"),
                                                 "log(ref/pi) clamped to +-this before k3 (NeMo RL's and verl's 20); "
                                                 "null: unclamped")
    kl_output_clamp_value: Optional[float] = knob(10.0, Elsewhere(LOSS_RULE, "> 0 or null"),
                                                  "k3 clamped to +-this (NeMo RL's and verl's 10); null: unclamped")
    truncated_importance_sampling_ratio: Optional[float] = knob(5.0, Elsewhere(LOSS_RULE, "> 0 or null"),
                                                                "cap of the trainer/generator importance weight; "
                                                                "null: no correction")
    token_level_loss: bool = knob(True, None, "average the loss over tokens (false: over sequences)")


@dataclass
class DynamicSampling:
    enabled: bool = knob(False, None, "DAPO: drop prompt groups whose scores are all equal, sample more")
    max_gen_batches: int = knob(4, Range(1, None), "rounds of num_prompts_per_step prompts per step at most")
    metric: str = knob("reward", OneOf(("reward", "accuracy")),
                       "what 'all equal' is judged on (never the overlong penalty): reward (reward.fn's score) "
                       "| accuracy (whether each sample scored >= 1, verl's DAPO acc)")


@dataclass
class OverlongPenalty:
    enabled: bool = knob(False, None, "DAPO soft overlong punishment over the last buffer_tokens")
    buffer_tokens: Optional[int] = knob(None, Elsewhere("validate._grpo_sampling", "in [1, grpo.max_new_tokens] "
                                                        "or null"), "length of the penalised tail; null: "
                                                                    "max_new_tokens // 4")
    max_penalty: float = knob(1.0, Range(0, None, say="must be 0 or more, got {value}"),
                              "the penalty at max_new_tokens")


@dataclass
class Pipeline:
    """Generation of the next steps while the trainers train (launcher.driver.pipeline)."""

    enabled: bool = knob(False, None, "generate step N's rollout with the weights after step N-1-max_lag")
    max_lag: int = knob(1, Range(1, 16), "weight versions between the generating and the training weights (each "
                                         "keeps one copy of the weights in flight; 0: set enabled=false)")


TOP_P_BIAS = ("must be 1.0, got {value}: the trainer's logprobs do not apply vLLM's top-p truncation, so the "
              "gradient would be biased (lower grpo.temperature to sharpen sampling)")


@dataclass
class Grpo:
    max_num_steps: int = knob(10, Range(1, None), "training steps of the run")
    num_prompts_per_step: int = knob(8, Range(1, None), "prompts per step (x generations: the step's batch)")
    num_generations_per_prompt: int = knob(2, Range(2, None), "samples per prompt, the group whose rewards are "
                                                              "compared (one: every advantage is 0)")
    max_new_tokens: int = knob(16, Range(1, None), "the most tokens generated per sample")
    max_total_sequence_length: int = knob(512, Elsewhere("validate._refit_and_vllm", "more than max_new_tokens"),
                                          "prompt + response tokens at most")
    temperature: float = knob(1.0, Range(VLLM_MIN_TEMPERATURE, None, say=f"must be at least {VLLM_MIN_TEMPERATURE} "
                                         f"(vLLM raises a lower one to it, the trainer would divide by the value "
                                         f"given), got {{value}}"),
                              "sampling temperature; the trainer's logprobs use the same")
    top_p: float = knob(1.0, All((Range(0, 1, lo_open=True), OneOf((1.0,), say=TOP_P_BIAS))),
                        "nucleus sampling; only 1.0 (the trainer's logprobs do not apply a truncation)")
    normalize_rewards: bool = knob(True, None, "divide each group's advantages by its reward std")
    use_leave_one_out_baseline: bool = knob(False, None, "baseline of a sample: its group's mean without it")
    advantage_clip: Optional[float] = knob(50.0, Range(0, None, lo_open=True, nullable=True),
                                           "advantages clipped to +-this; null: unclipped")
    reward_scaling: RewardScaling = section(RewardScaling, "a linear map of reward.fn's scores")
    loss: Loss = section(Loss, "the clipped GRPO loss (workers.trainer.loss)")
    val_period: int = knob(0, Range(0, None, say="must be 0 (off) or a number of steps, got {value}"),
                           "validate every N steps (0: never)")
    val_at_start: bool = knob(False, None, "validate once before the first step")
    val_max_examples: Optional[int] = knob(None, Range(1, None, nullable=True),
                                           "validation examples at most; null: all of data.validation")
    dynamic_sampling: DynamicSampling = section(DynamicSampling, "DAPO dynamic sampling")
    overlong_penalty: OverlongPenalty = section(OverlongPenalty, "DAPO overlong reward shaping")
    pipeline: Pipeline = section(Pipeline, "generation of the next steps while the trainers train")
    max_turns: int = knob(4, Range(1, 64), "model turns per episode at most (with env.fn; "
                                           "max_total_sequence_length bounds the whole episode)")


@dataclass
class Data:
    """Prompts: a built-in set or a .jsonl/.json/.parquet/.csv file (launcher.driver.data)."""

    train: str = knob("say_number", Elsewhere("driver.data.check", "a built-in set or a .jsonl/.json/.parquet/.csv "
                                              "file"), "the training prompts")
    validation: Optional[str] = knob(None, Elsewhere("driver.data.check", "like data.train, or null"),
                                     "the validation prompts; null: no validation")
    prompt_key: str = knob("prompt", Text(nullable=False), "the field of a record that holds the prompt")
    answer_key: str = knob("answer", Text(nullable=False), "the field the built-in rewards compare with")
    messages_key: Optional[str] = knob(None, Text(), "a field of chat messages to use instead of prompt_key")
    system_prompt: Optional[str] = knob(None, Free("any text, several lines allowed: it is sent to the model, never "
                                                   "to a shell"), "a system message put before each prompt")
    max_prompt_tokens: Optional[int] = knob(None, Range(1, None, nullable=True),
                                            "longer prompts are skipped; null: max_total_sequence_length - "
                                            "max_new_tokens")
    chat_template: str = knob("auto", OneOf(("auto", "none"), say="must be auto or none, got {value!r}"),
                              "auto: the tokenizer's chat template when it has one; none: the raw prompt")
    seed: int = knob(0, Range(0, 2**32 - 1), "seed of the per-epoch shuffle of the prompts")


@dataclass
class Env:
    """Multi-turn episodes: an environment answers each model turn (launcher.driver.environments)."""

    fn: Optional[str] = knob(None, Elsewhere("driver.environments.check", "a built-in environment or module:Class / "
                                             "file.py:Class, or null"),
                             "the environment class: Env(example) with first_messages() and respond(reply); null: "
                             "one prompt, one response")
    tools: list[str] = knob([], Elsewhere("driver.environments.check", "file.py:function or module:function each"),
                            "functions the model may call (env.fn=tools): shown through the chat template's tools")


@dataclass
class Reward:
    """fn(response: str, example: dict) -> float (launcher.driver.rewards)."""

    fn: Optional[str] = knob("say_number", Elsewhere("driver.rewards.check", "a built-in reward or module:function / "
                                                     "file.py:function; null only with env.fn"),
                             "the reward function (with env.fn: of the last reply, added to the environment's)")
    timeout_s: float = knob(10.0, Range(0, 86400, lo_open=True), "seconds one reward call may take")
    workers: int = knob(2, Range(1, 1024), "reward processes")
    on_error: str = knob("zero", OneOf(("zero", "fail"), say="must be zero or fail, got {value!r}"),
                         "a reward call that raises or times out: score 0, or fail the run")


@dataclass
class Optim:
    optimizer: str = knob("adam", OneOf(("adam", "sgd"), say="must be adam or sgd, got {value!r}"),
                          "Megatron's optimizer")
    lr: float = knob(1e-5, Range(0, None, lo_open=True), "peak learning rate")
    min_lr: float = knob(1e-5, Range(0, None), "the learning rate decays to this (at most lr)")
    weight_decay: float = knob(0.0, Range(0, None), "decoupled weight decay")
    adam_beta1: float = knob(0.9, Range(0, 1, hi_open=True), "Adam's beta1")
    adam_beta2: float = knob(0.999, Range(0, 1, hi_open=True), "Adam's beta2")
    adam_eps: float = knob(1e-8, Range(0, None, lo_open=True), "Adam's epsilon")
    clip_grad: float = knob(1.0, Range(0, None), "gradient norm clip (0: off)")
    lr_warmup_iters: int = knob(0, Range(0, None), "steps of linear warm-up")
    lr_decay_style: str = knob("constant", OneOf(("constant", "linear", "cosine", "inverse-square-root", "WSD")),
                               "Megatron's learning-rate schedule")
    lr_decay_iters: Optional[int] = knob(None, Range(1, None, nullable=True),
                                         "steps of the decay; null: grpo.max_num_steps")
    override_opt_param_scheduler: bool = knob(False, None, "on resume, this run's schedule instead of the saved one")
    use_distributed_optimizer: Any = knob("auto", OneOf(("auto", True, False)),
                                          "Megatron's distributed optimizer; auto: on cuda, not on cpu")


REFIT_MODES = ("merged", "merged_delta", "adapter")  # workers.refit.wire documents each
REFIT_TRANSPORTS = ("auto", "ray", "gloo", "nccl")   # auto: nccl on cuda, ray on cpu (workers.refit.control)


@dataclass
class Refit:
    mode: str = knob("merged", OneOf(REFIT_MODES), "what the trainers send vLLM after each step: merged weights, "
                                                   "their change, or the LoRA adapter (workers.refit.wire)")
    bucket_mb: int = knob(256, Range(1, None), "MiB per transfer bucket")
    transport: str = knob("auto", OneOf(REFIT_TRANSPORTS), "auto: nccl on cuda, ray on cpu "
                                                           "(workers.refit.control)")
    timeout_s: float = knob(600.0, Range(1, MAX_SECONDS), "seconds the broadcast group's collectives may take "
                                                          "(trainer rank 0 and every vLLM worker)")


@dataclass
class Checkpointing:
    enabled: bool = knob(True, None, "save checkpoints (LoRA adapters and optimizer state)")
    dir: Optional[str] = knob(None, Elsewhere("paths.path_error", "a path without % patterns or newlines, or null"),
                              "where checkpoints go; null: <run dir>/checkpoints")
    save_period: int = knob(5, Range(1, None), "save every N steps")
    keep_top_k: Optional[int] = knob(1, Range(1, None, nullable=True, say="must be at least 1 or null (keep all), "
                                                                          "got {value}"),
                                     "checkpoints kept, the best by metric_name (the latest is kept too); "
                                     "null: all")
    metric_name: str = knob(names.REWARD, OneOf(names.RANKABLE), "the step metric that ranks checkpoints")
    higher_is_better: bool = knob(True, None, "whether a higher metric_name is better")


SBATCH_RULE = "job.sbatch.job_spec"


@dataclass
class Slurm:
    partition: Optional[str] = knob(None, Text(), "sbatch --partition; null: the cluster's default")
    account: Optional[str] = knob(None, Text(), "sbatch --account")
    qos: Optional[str] = knob(None, Text(), "sbatch --qos")
    time_min: int = knob(240, Range(1, None, say="must be at least 1 minute, got {value}"),
                         "the job's time limit in minutes")
    signal_delay_s: int = knob(120, Elsewhere("validate._slurm", "in [0, time_min*60)"),
                               "seconds before the time limit the job is told to checkpoint and requeue")
    max_num_timeout: int = knob(3, Range(0, 1000), "requeues after a time-out at most")
    setup: list[str] = knob([], Elsewhere(SBATCH_RULE, "shell lines that parse"),
                            "shell lines run before the job starts Ray on its nodes (module load ...), under set -euo "
                            "pipefail on both submission paths: a line that fails stops the job")
    container_image: Optional[str] = knob(None, Text(), "pyxis --container-image; null: no container")
    container_mounts: Optional[str] = knob(None, Text(), "pyxis --container-mounts")
    extra_sbatch: dict[str, Any] = knob({}, Elsewhere(SBATCH_RULE, "sbatch long options the launcher does not set "
                                                      "itself"), "more sbatch options: {option: value}")
    python: Optional[str] = knob(None, Text(), "the python on the nodes; null: this one (sys.executable)")


@dataclass
class Run:
    """`run:`; conf/config.yaml names the run after its topology and model."""

    name: str = knob("run", Elsewhere("paths.run_name_error", "one path component"),
                     "the run directory <run.root>/<run.name>; conf/config.yaml's default: <topology>-<model> "
                     "(with model.path: the checkpoint directory's name)")
    root: str = knob("runs", Elsewhere("paths.path_error", "a path without % patterns or newlines"),
                     "where run directories go; a relative path is taken from the current directory")
    seed: int = knob(1234, Range(0, 2**32 - 1), "seed of the trainers and the sampler")
    job: str = knob("grpo", OneOf(JOBS), "grpo | preflight (check nodes, GPUs, paths, network first) | "
                                         "placement_smoke (check the cluster) | hold (keep the cluster up to attach to)")
    shared_with_group: bool = knob(False, None, "true: the run directory is readable by your group (0750/0640); "
                                                "else 0700/0600")


@dataclass
class Vllm:
    """`vllm:`; also the defaults of workers.generator.actor.GeneratorConfig (it inherits these
    fields). conf/config.yaml sets dtype and max_model_len from model.dtype and grpo."""

    dtype: str = knob("float32", OneOf(DTYPES), "vLLM's dtype")
    max_model_len: int = knob(512, Range(1, None), "vLLM's context length (at least grpo.max_total_sequence_length)")
    enforce_eager: Any = knob("auto", OneOf(("auto", True, False)),
                              "true: no CUDA graphs; auto: false on cuda (vLLM replays its decode steps as CUDA "
                              "graphs; every refit writes the weights in place, tests/integration/test_generator.py), "
                              "true on cpu (no graphs there)")
    gpu_memory_utilization: float = knob(0.8, Range(0, 1, lo_open=True),
                                         "GPU only: vLLM's share of a GPU (weights, activations, KV cache); the rest "
                                         "holds what refit allocates (launcher.memory plans both)")
    kv_cache_memory_bytes: int = knob(64 * 2**20, Range(2**20, None), "CPU only: a small KV cache, a fast start")
    max_lora_rank: int = knob(16, OneOf(VLLM_LORA_RANKS, say=f"vLLM allows {', '.join(map(str, VLLM_LORA_RANKS))}; "
                                                             "got {value}"),
                              "refit.mode=adapter: the largest LoRA rank vLLM serves (at least peft.dim)")


@dataclass
class RayCfg:
    """`ray:`"""

    port: int = knob(6379, PORT, "GCS port on the head node")
    node_manager_port: int = knob(6800, PORT, "pinned so firewalls can be opened once")
    object_manager_port: int = knob(6801, PORT, "pinned so firewalls can be opened once")
    min_worker_port: int = knob(10002, PORT, "lowest port of Ray's workers")
    max_worker_port: int = knob(10999, PORT, "highest port of Ray's workers")
    object_store_mb: int = knob(256, Range(75, None), "object store per node (Ray refuses one under 75 MiB)")
    register_timeout_s: float = knob(120.0, Range(0, MAX_SECONDS, lo_open=True),
                                     "the driver fails, naming the missing nodes, when no further node registered "
                                     "for this long")
    join_retries: int = knob(3, Range(1, 100), "attempts of a node's `ray start` (a worker's join, the head's "
                                                          "start when its daemons die)")
    join_jitter_s: float = knob(10.0, Range(0, 600), "a worker retries a refused `ray start` after a random delay "
                                                     "below this")
    # The GCS declares a node dead after health_check_failure_threshold failed checks in a row, one every
    # health_check_period_s; a check fails when the raylet refuses it (a node that is gone: threshold x period,
    # 10 x 5 s = 50 s, inside the 60 s the lost-node tests promise; the node's bootstrap reports a lost Ray
    # within seconds anyway) or does not answer within health_check_timeout_s (a raylet starved of CPU by a
    # checkpoint save, a merged refit's packing or a data loader: 10 x (30 + 5) s = about 6 minutes unanswered).
    # Ray's own defaults (ray_config_def.h: 3 s, 10 s, 5) declare a raylet dead after about 65 s without an
    # answer, and one busy minute on a node ended a whole job. A host that vanishes is also Slurm's to notice.
    health_check_period_s: float = knob(5.0, Range(0.1, 600), "the Ray head checks each node's raylet this often")
    health_check_timeout_s: float = knob(30.0, Range(0.1, 3600), "a raylet that answers no check within this "
                                                                 "counts one failure (starved, not gone)")
    health_check_failure_threshold: int = knob(10, Range(1, 1000), "failed checks in a row before Ray declares a "
                                                                   "node dead: threshold x period for a node that is "
                                                                   "gone (50 s), threshold x (timeout + period) for "
                                                                   "one that answers nothing (about 6 min; Ray's own "
                                                                   "defaults: about 65 s)")


@dataclass
class Logging:
    """`logging:`"""

    tensorboard: bool = knob(True, None, "write <run dir>/tensorboard")
    wandb_project: Optional[str] = knob(None, Text(), "set to log to Weights & Biases too (pip install wandb)")
    wandb_entity: Optional[str] = knob(None, Text(), "the Weights & Biases entity (team)")


@dataclass
class Retry:
    """`retry:`"""

    max_restarts: int = knob(0, All((Range(0, None, say="must be 0 or more, got {value}"), Range(None, 100))),
                             "after a failure (a dead actor or node), restart from the latest checkpoint up to N times")


# the sections no conf/ group sets: their values are the schema's defaults (conf/config.yaml takes
# every section from here, `schema/<name>@<name>` in its defaults list, and ties a few of these
# sections' keys to others; launcher.config.compose registers them)
SCHEMA_SECTIONS = {"run": Run, "vllm": Vllm, "ray": RayCfg, "retry": Retry, "logging": Logging}


@dataclass
class Config:
    topology: Topology = section(Topology, "nodes, devices and the roles' parallel layout (conf/topology)")
    model: Model = section(Model, "the model and its facts (conf/model)")
    peft: Peft = section(Peft, "the LoRA adapters (conf/peft)")
    grpo: Grpo = section(Grpo, "the GRPO algorithm (conf/grpo)")
    data: Data = section(Data, "the prompts (conf/data)")
    reward: Reward = section(Reward, "the reward function (conf/reward)")
    env: Env = section(Env, "multi-turn environments (conf/env)")
    optim: Optim = section(Optim, "the optimizer and its schedule (conf/optim)")
    refit: Refit = section(Refit, "the weight transfer trainer -> vLLM (conf/refit)")
    checkpointing: Checkpointing = section(Checkpointing, "checkpoints and their retention (conf/checkpointing)")
    slurm: Slurm = section(Slurm, "the sbatch job (conf/slurm)")
    run: Run = section(Run, "the run's name, directory and job")
    vllm: Vllm = section(Vllm, "the vLLM engines")
    ray: RayCfg = section(RayCfg, "the Ray cluster's ports and joining")
    logging: Logging = section(Logging, "TensorBoard and Weights & Biases")
    retry: Retry = section(Retry, "restarts after a failure")
    dry_run: bool = knob(False, None, "print the placement plan, the resolved config and the sbatch script; touch "
                                      "nothing")
    submit: bool = knob(True, None, "false: write the run directory, run or submit nothing")
    resume: Optional[str] = knob(None, Elsewhere("paths.path_error, run_dir.prepare", "step_N | latest | a "
                                                 "checkpoint path"), "continue from a checkpoint (+resume=...)")


def from_dict(cls, d: dict | None, section: str):
    """A section dataclass from plain data (what actors receive), refusing unknown keys."""
    import dataclasses

    d = dict(d or {})
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"{section}: unknown keys {sorted(unknown)}")
    return cls(**d)


# Rules that both the launcher's validation and the workers check (one definition each). They
# return ConfigErrors; a worker raises ValueError(str(error)) of the first.


def field_errors(section: Any, prefix: str = "") -> list[ConfigError]:
    """Each field of `section` (the Config, or one section with its dotted `prefix`, e.g. 'peft.')
    that its own check refuses (the check declared on the field), and each float not finite."""
    return [ConfigError(key, message) for key, message in fields.errors(section, prefix)]



def train_parallel_errors(train: TrainRole) -> list[ConfigError]:
    """Sequence and context parallelism of `topology.train` the trainer can run (on cpu too: the
    CPU shim runs sequence parallelism with megatron's torch norms)."""
    errs = []
    if train.sequence_parallel and train.tensor_parallel == 1:
        errs.append(ConfigError("topology.train.sequence_parallel", "needs train.tensor_parallel > 1"))
    if train.context_parallel != 1:
        errs.append(ConfigError("topology.train.context_parallel",
                                f"the trainer does not split sequences yet: must be 1, got {train.context_parallel}"))
    return errs


def loss_errors(loss: Loss) -> list[ConfigError]:
    """The `grpo.loss` values the GRPO loss accepts."""
    errs = []
    if loss.ratio_clip_min < 0 or loss.ratio_clip_max < 0:
        errs.append(ConfigError("grpo.loss.ratio_clip_min", "clip ranges must be non-negative"))
    if loss.ratio_clip_c is not None and loss.ratio_clip_c <= 1:
        errs.append(ConfigError("grpo.loss.ratio_clip_c", f"dual clip must be > 1 or null, got {loss.ratio_clip_c}"))
    if loss.truncated_importance_sampling_ratio is not None and loss.truncated_importance_sampling_ratio <= 0:
        errs.append(ConfigError("grpo.loss.truncated_importance_sampling_ratio", "must be positive or null"))
    for key in ("kl_input_clamp_value", "kl_output_clamp_value"):
        value = getattr(loss, key)
        if value is not None and not value > 0:
            errs.append(ConfigError(f"grpo.loss.{key}", f"must be positive or null, got {value}"))
    return errs


@functools.lru_cache(maxsize=1)
def _structured() -> DictConfig:
    """The schema as OmegaConf's structured config, made once (OmegaConf.merge copies its first argument,
    so the one made here is never changed)."""
    return OmegaConf.structured(Config)


def typed(cfg: DictConfig) -> Config:
    """Merge `cfg` into the schema; a type error or unknown key becomes a ConfigError."""
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    try:
        # as plain data: a section Hydra composed from the schema (every section) would otherwise
        # drop a key added to it with +key=value instead of refusing it
        merged = OmegaConf.merge(_structured(), OmegaConf.create(OmegaConf.to_container(cfg)))
    except ConfigKeyError as e:
        raise ConfigError(str(e.full_key), "unknown key (check the spelling)") from None
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", "") or "config")
        raise ConfigError(key, expected(key, getattr(e, "value", None))) from None
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def expected(full_key: str, value: Any) -> str:
    """What a value of the wrong type at `full_key` gets said: 'expected integer, got 'abc''."""
    return f"expected {_expected_type(full_key)}, got {value!r}"


def _expected_type(full_key: str) -> str:
    """The declared type of a dotted key, in words ('integer', 'list of strings', ...)."""
    import dataclasses
    import typing

    hints: Any = typing.get_type_hints(Config)
    tp: Any = Config
    for part in full_key.split("."):
        hints = typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else {}
        tp = hints.get(part, Any)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1:
        return _expected_word(args[0]) + " or null"
    return _expected_word(tp)


def _expected_word(tp: Any) -> str:
    import typing

    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if typing.get_origin(tp) is list:
        return "a list like [a, b]"
    if typing.get_origin(tp) is dict:
        return "a mapping like {key: value}"
    return words.get(tp, "a value of the declared type")
