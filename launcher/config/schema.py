"""Typed schema of the config tree (the YAML files in conf/ hold the values, this holds the types).

`typed(cfg)` merges a composed DictConfig into these dataclasses, so a wrong type
(`grpo.max_num_steps=abc`) or a misspelt key becomes a ConfigError naming the key. Workers
receive the plain sections they need (`OmegaConf.to_container(cfg.peft)`), not this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from launcher.driver import metric_names as names


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


@dataclass
class TrainRole:
    nodes: int = 1
    ranks_per_node: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 0   # sequences per forward/backward pass of a trainer rank; 0: its whole shard at once


@dataclass
class GenerationRole:
    nodes: int = 1
    ranks_per_node: int = 1
    engines: int = 1
    tensor_parallel: int = 1


@dataclass
class Topology:
    name: str = "local"
    executor: str = "local"
    device: str = "cpu"
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_node: Optional[int] = None
    colocate_roles: bool = False
    gpu_memory_gib: float = 184.0   # per GPU, for the memory plan (launcher.memory); GB200: 186 GB, CUDA reports ~185 GiB
    train: TrainRole = field(default_factory=TrainRole)
    generation: GenerationRole = field(default_factory=GenerationRole)


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
    # Qwen3: q/k RMSNorm per head
    "tiny_qwen3": dict(family="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # Qwen3-MoE: 4 experts, top-2, on every layer (EP2 puts 2 on each rank); head_dim 32 for vLLM CPU
    "tiny_qwen3_moe": dict(family="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=64),
}


@dataclass
class ParameterCounts:
    """`model.size`: what the memory plan (launcher.memory) reads when the checkpoint is not on this
    machine (a dry run for a cluster); with model.path here its safetensors headers say it all."""

    parameters: Optional[int] = None          # every weight
    expert_parameters: Optional[int] = None   # of which routed experts
    moe_layers: Optional[int] = None          # layers with routed experts (null: num_layers when there are experts)
    attention_layers: Optional[int] = None    # layers with a KV cache (null: num_layers)


@dataclass
class Model:
    """`model:`. The facts (family .. family_facts) are resolved once, at composition, from
    model.path's config.json or the built-in recipe (launcher.config.model_facts), and the run's
    config.yaml holds them; a value stated in conf/ or on the command line serves only a dry run
    for a checkpoint that is not on this machine (it is noted and replaced where one is)."""

    name: str = "tiny_llama"          # with model.path: the checkpoint directory's name
    path: Optional[str] = None
    builtin: Optional[str] = None
    dtype: str = "float32"
    family: Optional[str] = None
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None
    head_dim: Optional[int] = None
    num_experts: Optional[int] = None
    moe_router_topk: Optional[int] = None   # experts per token (0: dense)
    ffn_hidden_size: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    tie_word_embeddings: Optional[bool] = None
    qkv_bias: Optional[bool] = None
    qk_norm: Optional[bool] = None
    rope_theta: Optional[float] = None
    rope_scaling: dict[str, Any] = field(default_factory=dict)   # {}: plain RoPE
    max_position_embeddings: Optional[int] = None
    family_facts: dict[str, Any] = field(default_factory=dict)
    facts_from: Optional[str] = None        # <model.path>/config.json | builtin:<recipe> | null: not resolved
    size: ParameterCounts = field(default_factory=ParameterCounts)   # not a fact: the memory plan's counts


@dataclass
class Peft:
    enabled: bool = True
    target_modules: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj"])
    dim: int = 16
    alpha: float = 32
    dropout: float = 0.0
    dropout_position: str = "post"
    lora_A_init_method: str = "xavier"
    lora_B_init_method: str = "zero"
    lora_dtype: Optional[str] = None
    freeze_moe_router: bool = False


@dataclass
class RewardScaling:
    enabled: bool = True
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = -1.0
    target_max: float = 1.0


@dataclass
class Loss:
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.28
    ratio_clip_c: Optional[float] = 10.0
    reference_policy_kl_penalty: float = 0.0
    # k3 to the reference: log(ref/pi) clamped to +-kl_input_clamp_value, k3 to +-kl_output_clamp_value
    # (NeMo RL's and verl's 20 and 10); null: unclamped
    kl_input_clamp_value: Optional[float] = 20.0
    kl_output_clamp_value: Optional[float] = 10.0
    truncated_importance_sampling_ratio: Optional[float] = 5.0
    token_level_loss: bool = True


@dataclass
class DynamicSampling:
    enabled: bool = False          # DAPO: drop prompt groups whose scores are all equal, sample more
    max_gen_batches: int = 4       # rounds of num_prompts_per_step prompts per step at most
    # what "all equal" is judged on (never the overlong penalty): reward (reward.fn's score, NeMo RL's
    # raw reward) | accuracy (whether each sample scored >= 1, verl's DAPO `acc`)
    metric: str = "reward"


@dataclass
class OverlongPenalty:
    enabled: bool = False               # DAPO soft overlong punishment over the last buffer_tokens
    buffer_tokens: Optional[int] = None  # null: max_new_tokens // 4
    max_penalty: float = 1.0


@dataclass
class Pipeline:
    """Generation of the next steps while the trainers train (launcher.driver.pipeline)."""

    enabled: bool = False          # the rollout of step N generated with the weights after step N-1-max_lag
    max_lag: int = 1               # weight versions between the generating and the training weights


@dataclass
class Grpo:
    max_num_steps: int = 10
    num_prompts_per_step: int = 8
    num_generations_per_prompt: int = 2
    max_new_tokens: int = 16
    max_total_sequence_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    advantage_clip: Optional[float] = 50.0
    reward_scaling: RewardScaling = field(default_factory=RewardScaling)
    loss: Loss = field(default_factory=Loss)
    val_period: int = 0                      # validate every N steps (0: never)
    val_at_start: bool = False
    val_max_examples: Optional[int] = None
    dynamic_sampling: DynamicSampling = field(default_factory=DynamicSampling)
    overlong_penalty: OverlongPenalty = field(default_factory=OverlongPenalty)
    pipeline: Pipeline = field(default_factory=Pipeline)


@dataclass
class Data:
    """Prompts: a built-in set or a .jsonl/.json/.parquet/.csv file (launcher.driver.data)."""

    train: str = "say_number"
    validation: Optional[str] = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    messages_key: Optional[str] = None
    system_prompt: Optional[str] = None
    max_prompt_tokens: Optional[int] = None   # null: max_total_sequence_length - max_new_tokens
    chat_template: str = "auto"               # auto | none
    seed: int = 0


@dataclass
class Reward:
    """fn(response: str, example: dict) -> float (launcher.driver.rewards)."""

    fn: str = "say_number"
    timeout_s: float = 10.0
    workers: int = 2                          # reward processes
    on_error: str = "zero"                    # zero | fail


@dataclass
class Optim:
    optimizer: str = "adam"
    lr: float = 1e-5
    min_lr: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "constant"
    lr_decay_iters: Optional[int] = None
    override_opt_param_scheduler: bool = False
    use_distributed_optimizer: Any = "auto"


REFIT_MODES = ("merged", "merged_delta", "adapter")  # workers.refit.wire documents each
REFIT_TRANSPORTS = ("auto", "ray", "gloo", "nccl")   # auto: nccl on cuda, ray on cpu (workers.refit.control)


@dataclass
class Refit:
    mode: str = "merged"
    bucket_mb: int = 256
    transport: str = "auto"
    timeout_s: float = 600.0   # the broadcast group's collectives (trainer rank 0 and every vLLM worker)


@dataclass
class Checkpointing:
    enabled: bool = True
    dir: Optional[str] = None
    save_period: int = 5
    keep_top_k: Optional[int] = 1
    metric_name: str = names.REWARD
    higher_is_better: bool = True


@dataclass
class Slurm:
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time_min: int = 240
    signal_delay_s: int = 120
    max_num_timeout: int = 3
    setup: list[str] = field(default_factory=list)
    container_image: Optional[str] = None
    container_mounts: Optional[str] = None
    extra_sbatch: dict[str, Any] = field(default_factory=dict)
    python: Optional[str] = None


@dataclass
class Run:
    """`run:`; conf/config.yaml names the run after its topology and model."""

    name: str = "run"
    root: str = "runs"                # relative paths are taken from the current directory
    seed: int = 1234
    # grpo | preflight (check nodes, GPUs, paths, network first) | placement_smoke (check the
    # cluster) | hold (keep the cluster up to attach to)
    job: str = "grpo"
    shared_with_group: bool = False   # true: the run directory is readable by your group (0750/0640); else 0700/0600


@dataclass
class Vllm:
    """`vllm:`; also the defaults of workers.generator.actor.GeneratorConfig (it inherits these
    fields). conf/config.yaml sets dtype and max_model_len from model.dtype and grpo."""

    dtype: str = "float32"
    max_model_len: int = 512
    enforce_eager: bool = True
    # GPU only: vLLM's share of a GPU (weights, activations, KV cache). The rest holds what refit allocates
    # once the KV cache exists (buckets, one layer's weights in a merged refit): launcher.memory plans both
    gpu_memory_utilization: float = 0.8
    kv_cache_memory_bytes: int = 64 * 2**20   # CPU only: a small KV cache, a fast start
    max_lora_rank: int = 16                   # refit.mode=adapter; vLLM allows 1,8,16,32,64,128,256,320,512


@dataclass
class RayCfg:
    """`ray:`"""

    port: int = 6379                  # GCS port on the head node
    node_manager_port: int = 6800     # pinned so firewalls can be opened once
    object_manager_port: int = 6801
    min_worker_port: int = 10002
    max_worker_port: int = 10999
    object_store_mb: int = 256        # per node
    register_timeout_s: float = 120.0  # the driver fails, naming the missing nodes, when no further node registered for this long
    join_retries: int = 3
    join_jitter_s: float = 10.0       # a worker retries a refused `ray start` after a random delay below this


@dataclass
class Logging:
    """`logging:`"""

    tensorboard: bool = True               # <run dir>/tensorboard
    wandb_project: Optional[str] = None    # set to log to Weights & Biases too (pip install wandb)
    wandb_entity: Optional[str] = None


@dataclass
class Retry:
    """`retry:`"""

    max_restarts: int = 0   # after a failure (a dead actor or node), restart from the latest checkpoint up to N times


# the sections whose defaults are the schema's alone: conf/config.yaml takes them from here
# (`schema/<name>@<name>` in its defaults list; launcher.config.compose registers them)
SCHEMA_SECTIONS = {"run": Run, "vllm": Vllm, "ray": RayCfg, "retry": Retry, "logging": Logging}


@dataclass
class Config:
    topology: Topology = field(default_factory=Topology)
    model: Model = field(default_factory=Model)
    peft: Peft = field(default_factory=Peft)
    grpo: Grpo = field(default_factory=Grpo)
    data: Data = field(default_factory=Data)
    reward: Reward = field(default_factory=Reward)
    optim: Optim = field(default_factory=Optim)
    refit: Refit = field(default_factory=Refit)
    checkpointing: Checkpointing = field(default_factory=Checkpointing)
    slurm: Slurm = field(default_factory=Slurm)
    run: Run = field(default_factory=Run)
    vllm: Vllm = field(default_factory=Vllm)
    ray: RayCfg = field(default_factory=RayCfg)
    logging: Logging = field(default_factory=Logging)
    retry: Retry = field(default_factory=Retry)
    dry_run: bool = False
    submit: bool = True
    resume: Optional[str] = None   # added by +resume=...


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


def typed(cfg: DictConfig) -> Config:
    """Merge `cfg` into the schema; a type error or unknown key becomes a ConfigError."""
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    try:
        # as plain data: a section Hydra composed from the schema (SCHEMA_SECTIONS) would otherwise
        # drop a key added to it with +key=value instead of refusing it
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(OmegaConf.to_container(cfg)))
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
