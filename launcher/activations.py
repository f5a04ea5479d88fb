"""Training activations of one trainer rank, per micro-batch: what its forward keeps for the backward,
estimated from the model's facts, the layout and `topology.train.recompute` (launcher.memory adds it
to the plan and refuses a plan that does not fit).

The terms follow megatron-core's own accounting (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", which Megatron-Bridge's
training/utils/theoretical_memory_utils.py implements for GPT models: sequence x micro-batch x
hidden x per-layer coefficients, divided by TP under sequence parallelism, fp32 logits for the
loss), written per layer kind so that a hybrid's Mamba, MLP, MoE and latent-MoE layers each count
what they keep. Tokens T = micro-batch sequences x grpo.max_total_sequence_length (padded batches:
the longest). Per token, in the model's dtype unless said (h hidden, k experts per token, f one
expert's width, L the latent width, or h without LatentMoE):

  every layer        its input h (the residual stream) and its norm's output h; `layernorm`
                     recompute drops the norm's output where the norm is a module of its own
                     (Transformer Engine fuses the attention's and the dense MLP's norm into their
                     first linear: only the MoE layers' pre-MLP norm is recomputed; the local spec's
                     attention and MLP norms are modules too; megatron's MambaLayer recomputes none)
  attention  *       Q, K, V ((heads + 2 KV heads) x head_dim) and the context (heads x head_dim);
                     megatron's local and unfused attention also keep the probabilities (heads x
                     sequence per token) unless `core_attn` is recomputed; flash, fused and auto
                     (Transformer Engine's pick of those two) keep none
  Mamba-2    M       mamba_ssm's fused split-conv1d-scan keeps in_proj's output (2 x inner + 2 x groups
                     x state + heads) and the scan's output before the gate (inner: out_x); megatron's
                     MambaMixer runs the gated RMSNorm outside that kernel (`self.norm(y)`), which keeps
                     its input, the gated output (inner: layernorm_gated.LayerNormFn saves x); out_proj
                     keeps the norm's output (inner)
  MLP        -       fc1's output (x 2 for a gated MLP) and the activation's output; none with `mlp`
  MoE        E       the router's logits and scores (2 x experts, fp32); the dispatch: k copies of
                     each token's L (its input at the experts); the experts' fc1 output and activation
                     (k x f each; `moe_act` drops the activation), fc2's output (k x L, weighted at
                     the combine); LatentMoE adds fc1_latent_proj's output and fc2_latent_proj's
                     input (L each); the shared expert keeps fc1's output and its activation (`shared_
                     experts` drops both); `moe` keeps only the layer's input. Routing is taken as
                     balanced (a frozen router's imbalance is not modelled).
  final              the final norm's input and output (2 h); the logits: the output layer's
                     (vocabulary / TP, in the dtype) and the loss's two fp32 copies of them
                     (workers.trainer.actor.MegatronTrainer._token_logprobs: .float(), the contiguous copy
                     vocab_parallel_cross_entropy keeps for its backward)
  recompute          full: every layer keeps only its input (megatron's uniform method, one layer
                     per unit); selective and full rebuild one unit's activations at a time in the
                     backward: the largest such unit is added.

Per rank everything is divided by TP (sequence parallelism splits the h-wide terms, TP the heads
and widths), except the h-wide terms without sequence parallelism; experts' widths by ETP, the
routed tokens spread evenly over EP. The layer spec: Transformer Engine's on cuda (the plan assumes
the nodes have it; the preflight checks), else the local one, as workers.trainer.provider_settings
builds it on CPU and on a CUDA node without it: megatron's local attention, no `moe_act` recompute
(no grouped GEMM), every norm a module of its own. Pipeline parallelism: the first stage holds
min(PP, micro-batches) micro-batches of its 1/PP of the layers. MTP layers are not counted: the
trainer builds none (docs/nemotron_h.md). Not modelled: the backward's transient gradients, allocator
fragmentation, the dispatcher's workspace, a router's imbalance: the plan keeps a margin
(launcher.memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.config.schema import Config, selective_modules

GIB = 2**30
FP32 = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
H_WIDE = ("input and norm", "router", "latent projections")  # per token, not split over TP without SP


@dataclass(frozen=True)
class Term:
    what: str
    bytes: float          # per trainer rank, for one micro-batch


@dataclass(frozen=True)
class Activations:
    tokens: int           # micro-batch sequences x sequence length
    micro_batch: int      # sequences
    sequence: int
    micro_batches: int    # per optimizer step on one rank
    recompute: str
    terms: list[Term]

    @property
    def gib(self) -> float:
        return sum(t.bytes for t in self.terms) / GIB

    def describe(self) -> str:
        return (f"activations per micro-batch of {self.micro_batch} x {self.sequence} tokens (recompute "
                f"{self.recompute}): " + " + ".join(f"{t.what} {gib(t.bytes / GIB)}" for t in self.terms if t.bytes)
                + f" = {self.gib:.1f} GiB")


@dataclass(frozen=True)
class Shape:
    """The facts the estimate reads (the run's `model:` section)."""

    units: tuple[str, ...]     # what full recompute checkpoints: a hybrid's layers, a transformer's (attention + MLP)
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int                   # a dense MLP's width
    gated: bool                # the MLP's fc1 makes two halves (SwiGLU); Nemotron-H's relu2 is not gated
    experts: int
    topk: int
    expert_ffn: int
    shared_ffn: int            # the shared expert's width (0: none)
    latent: int                # LatentMoE's width (0: none)
    mamba_heads: int
    mamba_head_dim: int
    mamba_groups: int
    mamba_state: int
    vocab: int

    @classmethod
    def of(cls, cfg: Config, vocab: int) -> "Shape | None":
        m, ff = cfg.model, cfg.model.family_facts or {}
        if None in (m.hidden_size, m.num_layers, m.num_attention_heads, m.num_query_groups, m.head_dim):
            return None
        pattern = ff.get("hybrid_override_pattern")
        experts = m.num_experts or 0
        if isinstance(pattern, str) and pattern:
            units = tuple(pattern)
        else:  # a transformer: each layer is attention and an MLP (its experts' when it has them)
            units = ("*" + ("E" if experts else "-"),) * m.num_layers
        shared_experts = ff.get("n_shared_experts", 1)
        shared = int(ff.get("moe_shared_expert_intermediate_size", 0) or 0) * int(1 if shared_experts is None
                                                                                 else shared_experts)
        return cls(units=units, hidden=m.hidden_size, heads=m.num_attention_heads, kv_heads=m.num_query_groups,
                   head_dim=m.head_dim, ffn=m.ffn_hidden_size or 0, gated=m.family != "nemotron_h", experts=experts,
                   topk=m.moe_router_topk or 0, expert_ffn=m.moe_ffn_hidden_size or 0, shared_ffn=shared,
                   latent=int(ff.get("moe_latent_size", 0) or 0), mamba_heads=int(ff.get("mamba_num_heads", 0) or 0),
                   mamba_head_dim=int(ff.get("mamba_head_dim", 0) or 0), mamba_groups=int(ff.get("n_groups", 0) or 0),
                   mamba_state=int(ff.get("ssm_state_size", 0) or 0), vocab=vocab)


def layer_bytes(symbol: str, s: Shape, dtype: int, sequence: int, backend: str, modules: tuple[str, ...],
                te: bool = True) -> dict[str, float]:
    """Bytes one layer of kind `symbol` keeps per token, at full width (before TP), by part (te: Transformer
    Engine's layer spec, which fuses the attention's and the MLP's norm into their first linear)."""
    h, d = s.hidden, dtype
    norm_recomputed = "layernorm" in modules and (symbol == "E" or (not te and symbol in "*-"))
    out = {"input and norm": h * d * (1 if norm_recomputed else 2)}
    if symbol == "*":
        out["attention"] = (2 * s.heads + 2 * s.kv_heads) * s.head_dim * d
        if backend in ("local", "unfused") and "core_attn" not in modules:
            out["attention probabilities"] = s.heads * sequence * d
    elif symbol == "M":
        inner = s.mamba_heads * s.mamba_head_dim
        out["Mamba"] = (2 * inner + 2 * s.mamba_groups * s.mamba_state + s.mamba_heads + 3 * inner) * d
    elif symbol == "-" and "mlp" not in modules:
        out["MLP"] = (3 if s.gated else 2) * s.ffn * d
    elif symbol == "E":
        width = s.latent or h
        if "moe" in modules:
            return out
        out["router"] = 2 * s.experts * FP32
        out["MoE dispatch"] = s.topk * width * d
        act = 0 if "moe_act" in modules else 1
        out["experts"] = s.topk * ((2 if s.gated else 1) * s.expert_ffn + act * s.expert_ffn + width) * d
        if s.latent:
            out["latent projections"] = 2 * s.latent * d
        if s.shared_ffn and "shared_experts" not in modules:
            out["shared expert"] = (3 if s.gated else 2) * s.shared_ffn * d
    return out


def estimate(cfg: Config, plan, vocab: int | None, transformer_engine: bool = True) -> Activations | None:
    """The activations of one trainer rank (plan: launcher.plan.build), or None without the facts;
    transformer_engine=False: as on a CUDA node without it (the module docstring)."""
    shape = Shape.of(cfg, vocab or 0)
    if shape is None:
        return None
    t = cfg.topology.train
    d = DTYPE_BYTES.get(cfg.model.dtype, 4)
    tp, pp, etp = plan.tp, plan.pp, plan.etp
    sp = tp > 1 and (t.sequence_parallel or shape.experts > 0)  # as workers.trainer.provider_settings sets it
    sequence = math.ceil(cfg.grpo.max_total_sequence_length / (tp if sp else 1)) * (tp if sp else 1)
    shard = math.ceil(cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt / plan.dp)
    micro = t.micro_batch_size or shard
    micro_batches = math.ceil(shard / micro)
    tokens = micro * sequence
    te = cfg.topology.device == "cuda" and transformer_engine  # as workers.trainer.provider_settings builds it
    backend = t.attention_backend if te else "local"
    modules = selective_modules(grouped_gemm=te) if t.recompute == "selective" else ()
    h_split = tp if sp else 1  # the h-wide terms are split over TP only with sequence parallelism

    def per_rank(part: str, b: float) -> float:
        if part in H_WIDE:
            return b * tokens / h_split
        return b * tokens / tp / (etp if part == "experts" else 1)

    def unit_parts(unit: str, recomputed: tuple[str, ...]) -> dict[str, float]:
        parts: dict[str, float] = {}
        for sym in unit:
            for p, b in layer_bytes(sym, shape, d, sequence, backend, recomputed, te).items():
                parts[p] = parts.get(p, 0.0) + per_rank(p, b)
        return parts

    kept: dict[str, float] = {}
    rebuilt = 0.0  # the largest unit's activations a recomputation rebuilds in the backward
    for unit in shape.units:
        everything = sum(unit_parts(unit, ()).values())
        if t.recompute == "full":
            kept["layer inputs"] = kept.get("layer inputs", 0.0) + shape.hidden * d * tokens / h_split
            rebuilt = max(rebuilt, everything)
            continue
        parts = unit_parts(unit, modules)
        for p, b in parts.items():
            kept[p] = kept.get(p, 0.0) + b
        rebuilt = max(rebuilt, everything - sum(parts.values()))
    in_flight = min(pp, micro_batches) / pp if pp > 1 else 1.0
    terms = [Term(_label(p, shape), b * in_flight) for p, b in kept.items()]
    terms.append(Term("final norm", 2 * shape.hidden * d * tokens / h_split))
    terms.append(Term("logits (output + 2 fp32 copies for the loss)", tokens * shape.vocab / tp * (d + 2 * FP32)))
    if t.recompute != "none":
        terms.append(Term("one layer rebuilt in the backward", rebuilt))
    return Activations(tokens=tokens, micro_batch=micro, sequence=sequence, micro_batches=micro_batches,
                       recompute=t.recompute, terms=terms)


def _label(part: str, s: Shape) -> str:
    counts = {sym: sum(u.count(sym) for u in s.units) for sym in "*M-E"}
    layers = {"attention": "*", "attention probabilities": "*", "Mamba": "M", "MLP": "-", "router": "E",
              "MoE dispatch": "E", "experts": "E", "latent projections": "E", "shared expert": "E"}
    if part in layers:
        return f"{part} ({counts[layers[part]]} layers)"
    if part == "input and norm":
        return f"layer inputs and norms ({sum(len(u) for u in s.units)} layers)"
    return part


def gib(x: float) -> str:
    """GiB to print: one decimal, three below 0.1 (one sequence's KV cache is MiB)."""
    return f"{x:.1f}" if x >= 0.1 or x == 0 else f"{x:.3f}"
