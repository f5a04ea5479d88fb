"""The trainer's settings on Megatron-Bridge's model provider, beyond the model's facts
(workers.trainer.provider_facts): the parallel layout, the MoE settings of a LoRA run, the shared
expert overlap, activation recompute, the attention backend, the layer spec without Transformer
Engine and the fusions this machine can run. `apply(provider, cfg, is_cpu, have_te)` sets them
before `finalize()` (workers.trainer.build); tests/unit/test_provider_settings.py probes the
provider it leaves, for the reference recipe's settings too, without building a model.

Where each setting comes from (the anchors: Megatron-Bridge's Nemotron 3 Super/Ultra recipes,
NeMo RL's Megatron policy):
  moe_shared_expert_overlap  off everywhere. The Bridge's Nemotron-H mapping turns it on (and
        copies config.json's value, transformers' default True); megatron-core's
        MoELayer.preprocess asserts with a latent MoE (`moe_latent_size`) and the overlap on, its
        config refuses `shared_experts` recompute with it, and on CPU it would put the shared
        expert on a torch.cuda.Stream. It only overlaps the shared expert's compute with the token
        dispatch; NeMo RL sets it False always, as the Bridge's Super/Ultra recipes do.
  recompute (topology.train.recompute)  none: megatron's default; selective: recompute_modules of
        the Bridge's Ultra LoRA recipe (launcher.config.schema.RECOMPUTE_MODULES) less `moe_act`
        where the experts are not one grouped GEMM (megatron-core refuses it then: on CPU, and on
        cuda without Transformer Engine); full: every layer from its input (method uniform, one
        layer per unit).
  mamba_training_ssm_states_dtype (topology.train.mamba_ssm_states_dtype)  a hybrid's SSM states
        between the scan's chunks, in the dtype vLLM keeps its SSM state cache in (auto: the
        generation's mamba_ssm_cache_dtype, else config.json's, else float32: vLLM's and transformers'
        default for Nemotron-H). megatron's default follows the activations (bf16): a train/generation
        mismatch over every Mamba layer that the importance weights would absorb. Where the installed
        mamba_ssm's scans take no `state_dtype`, megatron refuses the setting: auto then leaves it
        (the trainer's log says so), an explicit dtype is an error naming the key.
  attention_backend (topology.train.attention_backend)  the configured one where the model uses
        Transformer Engine's layer spec (default fused, the Bridge's recipes'); local (megatron's
        own attention, what the local spec builds) on CPU and without Transformer Engine. The
        hybrid provider's default was flash (flash-attn under TE), which the preflight now probes
        for when chosen (launcher.cluster.preflight.build_needs).

Megatron is imported inside the function (see workers.trainer.build for why).
"""

from __future__ import annotations

from typing import Any, Callable

from launcher.config.schema import selective_modules
from workers.trainer import kernels
from workers.trainer.config import TrainerConfig


def apply(provider: Any, cfg: TrainerConfig, is_cpu: bool, have_te: bool,
          probe: Callable[[str], str] = kernels.importable, hf_config: Any = None,
          state_dtype_ok: Callable[[], bool] = kernels.mamba_takes_state_dtype) -> list[str]:
    """Every setting above on `provider` (before finalize); `probe`: whether a fusion's kernel imports
    (workers.trainer.kernels); `hf_config`: the checkpoint's (config.json's mamba_ssm_cache_dtype);
    `state_dtype_ok`: whether mamba_ssm takes state_dtype. Returns notes for the trainer's log."""
    notes: list[str] = []
    p = cfg.parallel
    provider.tensor_model_parallel_size = p.tensor_parallel
    provider.pipeline_model_parallel_size = p.pipeline_parallel
    provider.context_parallel_size = p.context_parallel
    provider.expert_model_parallel_size = p.expert_parallel
    provider.expert_tensor_parallel_size = p.expert_tensor_parallel
    moe = bool(getattr(provider, "num_moe_experts", None))
    # MoE at TP>1: megatron's MoELayer refuses to train without sequence parallelism, so it is on
    provider.sequence_parallel = p.tensor_parallel > 1 and (p.sequence_parallel or moe)
    if moe and (cfg.peft.enabled or cfg.peft.freeze_moe_router):
        # The router is frozen (LoRA freezes every base weight): its load-balancing loss could only push
        # the other weights to re-balance a router that cannot change, and it depends on how the batch
        # is split over data-parallel ranks (a step at EP2 would differ from the same step at EP1).
        provider.moe_router_load_balancing_type, provider.moe_aux_loss_coeff = "none", 0.0
        # Its expert bias (Nemotron-H's bridge turns it on) is a buffer megatron moves every step unless
        # frozen: rate 0 as NeMo RL sets it, and apply_peft marks each router's bias frozen.
        provider.moe_router_bias_update_rate = 0.0
    if hasattr(provider, "moe_shared_expert_overlap"):
        provider.moe_shared_expert_overlap = False  # see the module docstring
    if provider.vocab_size % p.tensor_parallel:
        provider.should_pad_vocab = True  # megatron splits the vocab evenly over TP ranks
    local_spec = is_cpu or not have_te
    if local_spec:
        from megatron.bridge.models.gpt_provider import local_layer_spec

        if hasattr(provider, "transformer_layer_spec"):
            provider.transformer_layer_spec = local_layer_spec
        if hasattr(provider, "hybrid_stack_spec"):  # Nemotron-H: Mamba + attention + MLP/MoE layers
            from workers.trainer.hybrid_spec import local_hybrid_stack_spec

            provider.hybrid_stack_spec = local_hybrid_stack_spec
    # a fusion whose kernel does not import here is off (workers.trainer.kernels; all of them on CPU)
    for flag, value in kernels.settings(is_cpu, probe).items():
        if hasattr(provider, flag):
            setattr(provider, flag, value)
    provider.attention_backend = attention_backend("local" if local_spec else p.attention_backend)
    for key, value in recompute_settings(p.recompute, bool(getattr(provider, "moe_grouped_gemm", False))).items():
        setattr(provider, key, value)
    if "M" in str(getattr(provider, "hybrid_layer_pattern", None) or ""):  # a hybrid with Mamba layers
        name = ssm_states_dtype(p.mamba_ssm_states_dtype, cfg.generation_ssm_cache_dtype, hf_config)
        if state_dtype_ok():
            import torch

            provider.mamba_training_ssm_states_dtype = getattr(torch, name)
        elif p.mamba_ssm_states_dtype != "auto":
            raise ValueError(f"topology.train.mamba_ssm_states_dtype={name}: the installed mamba_ssm's scans take "
                             "no state_dtype (megatron-core refuses the setting); upgrade mamba_ssm or set auto")
        else:
            notes.append(f"Mamba training states follow the activations' dtype: the installed mamba_ssm takes no "
                         f"state_dtype (vLLM keeps them in {name}; topology.train.mamba_ssm_states_dtype)")
    return notes


def ssm_states_dtype(train: str, generation: str, hf_config: Any = None) -> str:
    """topology.train.mamba_ssm_states_dtype resolved: itself, else the dtype vLLM keeps the SSM state
    in (topology.generation.mamba_ssm_cache_dtype, else config.json's: vLLM's NemotronH config
    verifier reads it, defaulting to float32 as transformers' NemotronHConfig does)."""
    if train != "auto":
        return train
    if generation != "auto":
        return generation
    value = getattr(hf_config, "mamba_ssm_cache_dtype", None) or "float32"
    return "float32" if value == "auto" else str(value)


def attention_backend(name: str):
    """megatron-core's AttnBackend of that name."""
    from megatron.core.transformer.enums import AttnBackend

    return AttnBackend[name]


def recompute_settings(mode: str, grouped_gemm: bool) -> dict:
    """The provider's recompute fields for topology.train.recompute (none | selective | full)."""
    if mode == "none":
        return {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if mode != "selective":
        raise ValueError(f"topology.train.recompute: none, selective or full, got {mode!r}")
    return {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None,
            "recompute_modules": list(selective_modules(grouped_gemm))}
