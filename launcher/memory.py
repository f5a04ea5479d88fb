"""The memory plan: what one GPU of each role holds, from the model's size and the topology, before
anything is submitted (launcher.plan places the actors; this says whether they fit).

Per trainer rank: the weights (dense parameters split over TP x PP, routed experts over EP x ETP x
PP, those every TP rank holds whole over PP: moe_replicated_parameters), the gradient buffers and
Adam's state of what trains (LoRA factors, or everything without LoRA; the distributed optimizer
splits Adam over data parallelism), refit's buffers (rank 0 packs one bucket on the GPU while the
export holds one bucket's worth of tensors), a fixed reserve for the CUDA context and NCCL
communicators, and the activations of one micro-batch (launcher.activations: per layer kind,
`topology.train.recompute`, the MoE dispatch, the fp32 logits); what is left must be at least
ACTIVATION_MARGIN of them (what the estimate leaves out: the backward's transient gradients, the
allocator's fragmentation, a frozen router's imbalance). A plan that does not fit names the first
of micro_batch_size=1, recompute=selective, recompute=full that would, else the parallel sizes.
MTP layers (`mtp.*`) are in neither role: the trainer builds none (docs/nemotron_h.md), vLLM's
Nemotron-H skips them without speculative decoding. Per vLLM worker: vLLM takes
`vllm.gpu_memory_utilization` of the GPU for its weights (every parameter over TP, vLLM shards
experts by TP, but the replicated ones whole), its profiled activations and the KV cache, which
must hold at least one sequence of max_model_len (K and V of every attention layer, and a
hybrid's Mamba state: conv state in the dtype, SSM state in float32, vLLM's default for
Nemotron-H) or vLLM refuses to start. Refit allocates outside that budget, after the KV cache
exists: the broadcast buckets and, in a merged refit, what vLLM's layerwise reload buffers
(vllm/model_executor/model_loader/reload/layerwise.py keeps every tensor a layer receives until
the layer is complete: one MoE layer's unsharded experts) and the layer it then materialises to
load them into (`_layerwise_process`: `materialize_layer` allocates the module's own parameters,
its TP shard, while the buffered tensors are held; both go once copied into the kernel's
tensors); merged_delta keeps its base tensors in host memory and moves one module at a time
(workers.refit.vllm_extension), an adapter refit writes files. A plan that cannot fit is refused
in one line naming the key to change (validate.py calls `check`).

GPU memory is `topology.gpu_memory_gib` (GB200 by default). The model's numbers come from
`model_size(cfg)`: its architecture from the run's resolved facts (the `model:` section,
launcher.config.model_facts), its parameter counts from a checkpoint at model.path on this
machine (its safetensors headers), else the `model.size` section (for a dry run of a checkpoint
that is not here; its MTP layers estimated from the facts and left out), else a built-in recipe's
estimate; without any, there is no plan.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from launcher import activations
from launcher.activations import DTYPE_BYTES, GIB, gib
from launcher.config.schema import BUILTIN_MODELS, Config, ConfigError

TRAINER_RESERVE_GIB = 3.0       # CUDA context + megatron's NCCL communicators (TP, DP, EP, PP, refit)
ACTIVATION_MARGIN = 0.25        # free memory a trainer rank keeps beyond the activation estimate, as a share of it
MAMBA_CONV_KERNEL = 4           # NemotronHConfig's conv_kernel (launcher.config.model_facts refuses another)
MAMBA_SSM_STATE_BYTES = 4       # vLLM keeps a Nemotron-H's SSM state in float32 (its mamba_ssm_cache_dtype)
ENGINE_ACTIVATIONS_GIB = 4.0    # vLLM's profiled forward (inside its budget; CUDA graphs too: vLLM 0.32 profiles them
                                # and takes them out of the KV cache)
REFIT_GROUP_GIB = 0.5           # the refit group's NCCL communicator on a vLLM worker (outside vLLM's budget)
_EXPERT = re.compile(r"\.experts\.")          # routed experts (shared_experts are dense)
_REPLICATED = re.compile(r"layers\.\d+\.(?:mixer|mlp)\.(?:gate|fc[12]_latent_proj)\.")  # moe_replicated_parameters
_LAYER_MODULE = re.compile(r"^(.*?layers\.\d+\.(?:mixer|mlp)\.experts)\.")  # one MoE layer's experts: one vLLM module
_MTP = re.compile(r"^mtp\.")                  # MTP layers: neither the trainer nor vLLM loads them (module docstring)
_EMBEDDING = re.compile(r"embed")             # the input embedding: its rows are the vocabulary


@dataclass(frozen=True)
class ModelSize:
    parameters: int                 # every weight
    expert_parameters: int          # of which routed experts
    largest_module_parameters: int  # the most one vLLM module receives in a refit (one MoE layer's experts, the embedding)
    attention_layers: int           # layers with a KV cache
    hidden_size: int
    num_attention_heads: int
    kv_heads: int
    head_dim: int
    source: str                     # where the numbers came from (printed)
    vocab_size: int | None = None   # the embedding's rows (the logits' width); None: not known
    mtp_parameters: int = 0         # MTP layers' weights, not in `parameters` (module docstring)
    replicated_parameters: int = 0  # of `parameters`, those every TP rank holds whole (moe_replicated_parameters)


def model_size(cfg: Config) -> ModelSize | None:
    """The model's numbers the plan needs (see the module docstring for the order of sources). The
    architecture numbers are the run's resolved facts (launcher.config.model_facts: config.json or
    the recipe, in the `model:` section); the parameter counts the checkpoint's headers, model.size,
    or the recipe's estimate."""
    m = cfg.model
    if None in (m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim, m.num_layers):
        return None  # not resolved and not stated (a dry run for a checkpoint elsewhere)
    heads = dict(hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads, kv_heads=m.num_query_groups,
                 head_dim=m.head_dim)
    attention = _attention_layers(m)
    if m.path and Path(m.path).is_dir() and any(Path(m.path).glob("*.safetensors")):
        return _from_checkpoint(Path(m.path), attention, heads)
    s = getattr(m, "size", None)
    if s is not None and s.parameters:
        mtp, mtp_experts = mtp_parameters(m)
        experts = max(0, (s.expert_parameters or 0) - mtp_experts)
        pattern = (m.family_facts or {}).get("hybrid_override_pattern")
        moe_layers = s.moe_layers or (pattern.count("E") if isinstance(pattern, str) and "E" in pattern
                                      else m.num_layers if experts else 1)
        qkv = m.hidden_size * (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim
        return ModelSize(parameters=s.parameters - mtp, expert_parameters=experts,
                         largest_module_parameters=max(math.ceil(experts / moe_layers), qkv),
                         attention_layers=s.attention_layers or attention, source="model.size",
                         vocab_size=s.vocab_size, mtp_parameters=mtp,
                         replicated_parameters=moe_layers * moe_replicated_parameters(m) if experts else 0,
                         **heads)
    if m.path is None and m.builtin in BUILTIN_MODELS:
        return _from_recipe(m, attention, heads)
    return None


def _attention_layers(m) -> int:
    """Layers with a KV cache: a hybrid's attention (*) layers (its layer pattern, a family fact), else all."""
    pattern = (m.family_facts or {}).get("hybrid_override_pattern")
    return pattern.count("*") if isinstance(pattern, str) else m.num_layers


def _from_checkpoint(path: Path, attention: int, heads: dict) -> ModelSize:
    from safetensors import safe_open  # headers only (numpy framework: no torch)

    shapes: dict[str, list[int]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                shapes[name] = list(f.get_slice(name).get_shape())
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    mtp = sum(n for name, n in sizes.items() if _MTP.match(name))
    sizes = {name: n for name, n in sizes.items() if not _MTP.match(name)}
    experts = sum(n for name, n in sizes.items() if _EXPERT.search(name))
    replicated = sum(n for name, n in sizes.items() if _REPLICATED.search(name)) if experts else 0
    modules: dict[str, int] = {}
    for name, n in sizes.items():
        moe = _LAYER_MODULE.match(name)
        key = moe.group(1) if moe else name.rsplit(".", 1)[0]
        modules[key] = modules.get(key, 0) + n
    embedding = [shape[0] for name, shape in shapes.items() if _EMBEDDING.search(name) and len(shape) == 2
                 and not _MTP.match(name)]
    return ModelSize(parameters=sum(sizes.values()), expert_parameters=experts,
                     largest_module_parameters=max(modules.values(), default=0), attention_layers=attention,
                     source=f"{path} (safetensors headers)", vocab_size=max(embedding, default=None),
                     mtp_parameters=mtp, replicated_parameters=replicated, **heads)


def _from_recipe(m, attention: int, heads: dict) -> ModelSize:
    """A built-in recipe's parameters from its facts (workers.tiny_models builds them; untied embeddings)."""
    hidden, nh, kv, hd, layers = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim, m.num_layers
    pattern = (m.family_facts or {}).get("hybrid_override_pattern")
    vocab = BUILTIN_MODELS[m.builtin].get("vocab_size", 512)  # the tiny tokenizer's vocabulary is smaller
    qkv_o = hidden * (nh + 2 * kv) * hd + nh * hd * hidden
    experts = (m.num_experts or 0) * 3 * hidden * (m.moe_ffn_hidden_size or 0)   # one layer's
    moe_layers = (pattern.count("E") if isinstance(pattern, str) else layers) if experts else 0
    mlp_layers = pattern.count("-") if isinstance(pattern, str) else (0 if experts else layers)
    dense_mlp = 3 * hidden * (m.ffn_hidden_size or 0)
    total = 2 * vocab * hidden + attention * qkv_o + mlp_layers * dense_mlp + moe_layers * experts
    return ModelSize(parameters=total, expert_parameters=moe_layers * experts,
                     largest_module_parameters=max(vocab * hidden, experts, dense_mlp),
                     attention_layers=attention, source=f"built-in recipe {m.builtin} (estimate)", vocab_size=vocab,
                     **heads)


def layer_parameters(symbol: str, m) -> tuple[int, int]:
    """(weights, of which routed experts) of one layer of kind `symbol` (* attention, M Mamba-2, - MLP, E
    MoE; a Nemotron-H's, relu2 experts) from the model's facts, its norm included."""
    ff = m.family_facts or {}
    h, heads, kv, hd = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim
    if symbol == "*":
        return h * (heads + 2 * kv) * hd + heads * hd * h + h, 0
    if symbol == "-":
        return 2 * h * (m.ffn_hidden_size or 0) + h, 0
    if symbol == "M":
        nh, groups, state = ff.get("mamba_num_heads", 0), ff.get("n_groups", 0), ff.get("ssm_state_size", 0)
        inner, conv = nh * ff.get("mamba_head_dim", 0), nh * ff.get("mamba_head_dim", 0) + 2 * groups * state
        return h * (2 * inner + 2 * groups * state + nh) + conv * (MAMBA_CONV_KERNEL + 1) + 3 * nh + inner \
            + inner * h + h, 0
    latent, experts = ff.get("moe_latent_size", 0) or 0, m.num_experts or 0
    routed = experts * 2 * (latent or h) * (m.moe_ffn_hidden_size or 0)
    shared_experts = ff.get("n_shared_experts", 1)
    shared = 2 * h * (ff.get("moe_shared_expert_intermediate_size", 0) or 0) * (1 if shared_experts is None
                                                                               else shared_experts)
    return routed + shared + moe_replicated_parameters(m) + experts + h, routed


def moe_replicated_parameters(m) -> int:
    """The weights of one MoE layer that megatron and vLLM both keep whole on every TP rank (a plan that
    divided them by TP under-counted both roles): LatentMoE's fc1_latent_proj and fc2_latent_proj (hidden
    x latent each: megatron-core's MoELayer builds them TELinear(parallel_mode="duplicated"), vLLM's
    NemotronHMoE ReplicatedLinear) and the router (experts x hidden: megatron's Router.weight, a plain
    Parameter; vLLM's GateLinear, a ReplicatedLinear). A checkpoint's are read by name (_REPLICATED)."""
    latent = (m.family_facts or {}).get("moe_latent_size", 0) or 0
    return 2 * m.hidden_size * latent + (m.num_experts or 0) * m.hidden_size


def mtp_parameters(m) -> tuple[int, int]:
    """(weights, of which routed experts) of the MTP layers config.json's facts describe: per step its
    pattern's layers, the projection of [embedding; hidden] (2h x h) and three norms."""
    ff = m.family_facts or {}
    depth, pattern = ff.get("num_nextn_predict_layers", 0) or 0, ff.get("mtp_hybrid_override_pattern", "") or ""
    if not depth or not pattern or m.hidden_size is None:
        return 0, 0
    layers = [layer_parameters(sym, m) for sym in pattern]
    h = m.hidden_size
    return depth * (sum(w for w, _ in layers) + 2 * h * h + 3 * h), depth * sum(e for _, e in layers)


# ------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Line:
    what: str
    gib: float


@dataclass
class MemoryPlan:
    gpu_gib: float
    size: ModelSize | None
    trainer: list[Line]
    engine: list[Line]          # inside vLLM's budget
    engine_outside: list[Line]  # refit, outside it
    budget_gib: float
    notes: list[str]
    errors: list[ConfigError]
    activations: activations.Activations | None = None   # the trainer's activations line, term by term

    def describe(self) -> str:
        if self.size is None:
            return "\n".join(self.notes)
        out = [f"memory per GPU ({self.gpu_gib:g} GiB, topology.gpu_memory_gib; model: {self.size.source})"]
        total = sum(x.gib for x in self.trainer)
        out.append(f"  trainer rank: {total:.1f} GiB = " + " + ".join(f"{x.what} {gib(x.gib)}" for x in self.trainer)
                   + f"; {self.gpu_gib - total:.1f} GiB free")
        if self.activations is not None:
            out.append(f"    {self.activations.describe()}")
        inside, outside = sum(x.gib for x in self.engine), sum(x.gib for x in self.engine_outside)
        out.append(f"  vLLM worker: budget {self.budget_gib:.1f} GiB (vllm.gpu_memory_utilization) holds "
                   + " + ".join(f"{x.what} {gib(x.gib)}" for x in self.engine)
                   + f" = {inside:.1f}, the rest is KV cache")
        out.append(f"  vLLM worker, outside the budget ({self.gpu_gib - self.budget_gib:.1f} GiB): "
                   + " + ".join(f"{x.what} {gib(x.gib)}" for x in self.engine_outside) + f" = {outside:.1f}")
        out += [f"  note: {n}" for n in self.notes]
        out += [f"  DOES NOT FIT: {e}" for e in self.errors]
        return "\n".join(out)


def plan_memory(cfg: Config, plan) -> MemoryPlan:
    """The memory plan of a config whose topology passed plan.check (plan = plan.build(topology))."""
    gpu = float(cfg.topology.gpu_memory_gib)
    if cfg.topology.device != "cuda":
        return MemoryPlan(gpu, None, [], [], [], 0.0, ["memory: no GPU plan on cpu"], [])
    size = model_size(cfg)
    if size is None:
        return MemoryPlan(gpu, None, [], [], [], 0.0, [
            f"memory: no plan: model.path {cfg.model.path} is not on this machine and model.size.parameters "
            f"is not set"], [])
    trainer, acts, trainer_notes, trainer_errors = _trainer(cfg, plan, size, gpu)
    inside, outside, budget, notes, engine_errors = _engine(cfg, plan, size, gpu)
    return MemoryPlan(gpu, size, trainer, inside, outside, budget, trainer_notes + notes,
                      trainer_errors + engine_errors, acts)


def _trainer(cfg: Config, plan, size: ModelSize, gpu: float) -> tuple:
    """(lines, activations, notes, errors) of one trainer rank."""
    lines = _trainer_state(cfg, plan, size)
    state = sum(x.gib for x in lines)
    acts = activations.estimate(cfg, plan, size.vocab_size)
    notes, errors = [], []
    if acts is None:
        notes.append("trainer activations not estimated (the model's facts are not known)")
    elif not size.vocab_size:
        notes.append("the logits are not counted in the activations (the vocabulary is not known: set "
                     "model.size.vocab_size)")
    if acts is not None:
        lines.append(Line(f"activations (recompute {acts.recompute}, micro-batch {acts.micro_batch})", acts.gib))
    if state > gpu:
        errors.append(ConfigError("topology.train.tensor_parallel", (
            f"a trainer rank needs {state:.1f} GiB before activations ({_sum(lines[:5])}) on a {gpu:g} GiB GPU "
            f"(topology.gpu_memory_gib): raise topology.train.tensor_parallel, pipeline_parallel or expert_parallel")))
    elif acts is not None and not _fits(state, acts, gpu):
        errors.append(_activations_error(cfg, plan, size, gpu, state, acts))
    return lines, acts, notes, errors


def _fits(state: float, acts: activations.Activations, gpu: float) -> bool:
    return state + acts.gib * (1 + ACTIVATION_MARGIN) <= gpu


def _activations_error(cfg: Config, plan, size: ModelSize, gpu: float, state: float,
                       acts: activations.Activations) -> ConfigError:
    """The trainer's activations do not fit: name the first change that makes them (micro-batch 1, then
    selective, then full recompute, then both), else the parallel sizes."""
    import copy

    t = cfg.topology.train
    order = ("none", "selective", "full")
    changes = ([{"micro_batch_size": 1}] if acts.micro_batch > 1 else []) + [
        {"recompute": r} for r in order[order.index(t.recompute) + 1:]]
    if acts.micro_batch > 1:
        changes += [{"micro_batch_size": 1, "recompute": r} for r in order[order.index(t.recompute) + 1:]]
    head = (f"a trainer rank needs {state:.1f} GiB ({_sum(_trainer_state(cfg, plan, size))}) + activations "
            f"{acts.gib:.1f} GiB for {acts.micro_batch} x {acts.sequence} tokens at recompute {acts.recompute} "
            f"(+{ACTIVATION_MARGIN:.0%} margin) on a {gpu:g} GiB GPU (topology.gpu_memory_gib)")
    for change in changes:
        trial = copy.deepcopy(cfg)
        for key, value in change.items():
            setattr(trial.topology.train, key, value)
        then = activations.estimate(trial, plan, size.vocab_size)
        if then is not None and _fits(state, then, gpu):
            keys = " and ".join(f"topology.train.{k}={v}" for k, v in change.items())
            return ConfigError(f"topology.train.{next(iter(change))}",
                               f"{head}: set {keys} (activations {then.gib:.1f} GiB)")
    return ConfigError("topology.train.tensor_parallel", f"{head}, more than fits with micro_batch_size 1 and "
                                                         f"recompute full: raise topology.train.tensor_parallel or "
                                                         f"pipeline_parallel")


def _trainer_state(cfg: Config, plan, size: ModelSize) -> list[Line]:
    """Weights, gradients, Adam, refit and the CUDA context of one trainer rank (everything but activations)."""
    dtype = DTYPE_BYTES.get(cfg.model.dtype, 4)
    whole = size.replicated_parameters  # on every TP rank (moe_replicated_parameters)
    dense = size.parameters - size.expert_parameters - whole
    local = (dense / (plan.tp * plan.pp) + whole / plan.pp
             + size.expert_parameters / (plan.ep * plan.etp * plan.pp))
    trainable = _lora_parameters(cfg, size) / plan.tp if cfg.peft.enabled else local
    adam = (12 if dtype < 4 else 8) * trainable
    distributed = cfg.optim.use_distributed_optimizer in ("auto", True)  # auto: on cuda
    bucket = cfg.refit.bucket_mb * 2**20
    return [Line(f"weights (TP {plan.tp} x PP {plan.pp}, experts EP {plan.ep} x ETP {plan.etp})", local * dtype / GIB),
            Line("grads", trainable * 4 / GIB),
            Line("Adam" + (f" / DP {plan.dp}" if distributed and plan.dp > 1 else ""),
                 adam / (plan.dp if distributed else 1) / GIB),
            Line("refit (rank 0: a bucket and its tensors)", 2 * bucket / GIB),
            Line("CUDA + NCCL", TRAINER_RESERVE_GIB)]


def _engine(cfg: Config, plan, size: ModelSize, gpu: float) -> tuple:
    dtype = DTYPE_BYTES.get(cfg.vllm.dtype, 4)
    tp = plan.generation_tp
    util = cfg.vllm.gpu_memory_utilization
    budget = util * gpu
    kv_heads = max(1, size.kv_heads // tp)  # vLLM replicates KV heads when TP exceeds them
    kv_token = 2 * size.attention_layers * kv_heads * size.head_dim * dtype   # K and V
    kv_one = kv_token * cfg.vllm.max_model_len / GIB
    mamba_one = mamba_state_bytes(cfg.model, tp, dtype) / GIB
    sequences = math.ceil(cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt / plan.engines)
    kv_batch = (kv_token * cfg.grpo.max_total_sequence_length / GIB + mamba_one) * sequences
    whole = size.replicated_parameters  # on every TP rank (moe_replicated_parameters)
    inside = [Line(f"weights (TP {tp})", ((size.parameters - whole) / tp + whole) * dtype / GIB),
              Line("activations", ENGINE_ACTIVATIONS_GIB),
              Line("KV of one max_model_len sequence", kv_one)]
    if mamba_one:
        inside.append(Line("Mamba state of one sequence", mamba_one))
    bucket = cfg.refit.bucket_mb * 2**20 / GIB
    mode = cfg.refit.mode
    if mode == "merged":  # the module's weights as received (unsharded), and its own TP shard it loads them into
        reload = [Line("merged refit: one module's weights held by vLLM's layerwise reload",
                       size.largest_module_parameters * dtype / GIB),
                  Line(f"the layer it materialises (TP {tp})", size.largest_module_parameters * dtype / tp / GIB)]
    elif mode == "merged_delta":
        qkv = size.hidden_size * (size.num_attention_heads + 2 * size.kv_heads) * size.head_dim
        reload = [Line("merged_delta: one module's base and weights", 2 * qkv * dtype / GIB)]
    else:
        reload = [Line("adapter refit: LoRA factors", 0.0)]
    outside = [Line("refit buckets", 2 * bucket), *reload, Line("refit group", REFIT_GROUP_GIB)]
    need_in, need_out = sum(x.gib for x in inside), sum(x.gib for x in outside)
    notes, errors = [], []
    if need_in + need_out > gpu:
        errors.append(ConfigError("topology.generation.tensor_parallel", (
            f"a vLLM worker needs {need_in + need_out:.1f} GiB ({_sum(inside + outside)}) on a {gpu:g} GiB GPU "
            f"(topology.gpu_memory_gib) at TP {tp}: raise topology.generation.tensor_parallel")))
    elif need_in > budget:
        errors.append(ConfigError("vllm.gpu_memory_utilization", (
            f"{util:g} x {gpu:g} GiB = {budget:.1f} GiB cannot hold {_sum(inside)} = {need_in:.1f} GiB per vLLM "
            f"worker at TP {tp}: set it to at least {math.ceil(100 * need_in / gpu) / 100:.2f} (at most "
            f"{math.floor(100 * (1 - need_out / gpu)) / 100:.2f}: refit needs {need_out:.1f} GiB outside it)")))
    elif need_out > gpu - budget:
        errors.append(ConfigError("vllm.gpu_memory_utilization", (
            f"{util:g} leaves {gpu - budget:.1f} GiB outside vLLM's budget, refit needs {need_out:.1f} "
            f"({_sum(outside)}): set it to at most {math.floor(100 * (1 - need_out / gpu)) / 100:.2f}")))
    elif budget - need_in < kv_batch:
        notes.append(f"the KV cache ({budget - need_in:.1f} GiB) holds less than a step's {sequences} sequences of "
                     f"{cfg.grpo.max_total_sequence_length} tokens per engine ({kv_batch:.1f} GiB): vLLM queues them")
    if mode == "merged_delta":
        workers_here = max(len(n.generation_workers) for n in plan.nodes)
        bases = _target_parameters(cfg, size) * dtype * workers_here / GIB
        notes.append(f"merged_delta keeps the targeted modules' base weights in host memory: {bases:.1f} GiB per "
                     f"generation node ({workers_here} vLLM workers)")
    pattern = (cfg.model.family_facts or {}).get("hybrid_override_pattern")
    if size.source == "model.size" and not cfg.model.size.attention_layers and not isinstance(pattern, str):
        notes.append("KV cache counted on every layer (model.size.attention_layers is not set)")
    return inside, outside, budget, notes, errors


def mamba_state_bytes(m, tp: int, dtype: int) -> float:
    """One sequence's Mamba state on a vLLM worker at TP `tp` (prefix caching off for hybrids: one state
    per sequence, workers.generator.actor.has_mamba_layers): per Mamba layer the causal conv's last
    conv_kernel - 1 inputs (inner + 2 x groups x state channels, in the dtype) and the SSM state (heads
    x head_dim x state, in float32); vLLM splits heads and groups over TP (groups replicated where
    fewer than TP)."""
    ff = m.family_facts or {}
    pattern = ff.get("hybrid_override_pattern")
    layers = pattern.count("M") if isinstance(pattern, str) else 0
    if not layers:
        return 0.0
    heads, head_dim = ff.get("mamba_num_heads", 0), ff.get("mamba_head_dim", 0)
    groups, state = max(1, ff.get("n_groups", 0) // tp), ff.get("ssm_state_size", 0)
    conv = (MAMBA_CONV_KERNEL - 1) * (heads * head_dim / tp + 2 * groups * state) * dtype
    ssm = heads / tp * head_dim * state * MAMBA_SSM_STATE_BYTES
    return layers * (conv + ssm)


def _lora_parameters(cfg: Config, size: ModelSize) -> int:
    """LoRA factors: exact for attention targets; other targets approximated as r x 5 x hidden per layer."""
    r, h = cfg.peft.dim, size.hidden_size
    q = size.num_attention_heads * size.head_dim
    per = {"linear_qkv": r * (h + q + 2 * size.kv_heads * size.head_dim), "linear_proj": r * (q + h)}
    return sum(_per_layer(cfg, size, t, per, r * 5 * h) for t in cfg.peft.target_modules)


def _target_parameters(cfg: Config, size: ModelSize) -> int:
    """The base weights of the LoRA-targeted modules (attention exact; others approximated as 4 hidden^2)."""
    h, q = size.hidden_size, size.num_attention_heads * size.head_dim
    per = {"linear_qkv": h * (q + 2 * size.kv_heads * size.head_dim), "linear_proj": q * h}
    return sum(_per_layer(cfg, size, t, per, 4 * h * h) for t in cfg.peft.target_modules)


def _per_layer(cfg: Config, size: ModelSize, target: str, per: dict, other: int) -> int:
    short = target.rsplit(".", 1)[-1]
    return (size.attention_layers if short in per else cfg.model.num_layers) * per.get(short, other)


def _sum(lines: list[Line]) -> str:
    return " + ".join(f"{x.what} {gib(x.gib)}" for x in lines)



def check(cfg: Config, plan) -> list[ConfigError]:
    """The plan's refusals (none on cpu, none without the model's size)."""
    return plan_memory(cfg, plan).errors
