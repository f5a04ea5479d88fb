"""Every rule a config must pass before anything is written or submitted.

`validate(cfg, submitting)` returns a list of ConfigError (one line each: the key, what is wrong,
what is allowed). A field's own range or set is declared on the field (launcher.config.schema)
and checked first (launcher.config.ranges); the topology arithmetic lives in launcher.plan. This
module holds the rules that tie fields and sections together (the topology to the model, LoRA,
vLLM, GRPO, checkpointing and Slurm) or read files and the environment (the model directory, the
prompts, the reward function, wandb). Paths are only required to exist when submitting (a dry
run can plan for a cluster whose filesystem this machine does not see).
"""

from __future__ import annotations


from launcher import memory, paths
from launcher import plan as plan_mod
from launcher.config import job_limits, model_facts, model_files
from launcher.config import ranges
from launcher.config.schema import BUILTIN_MODELS, LORA_MODULES, LORA_NOT_IN_PEFT, Config, ConfigError, loss_errors


def validate(cfg: Config, submitting: bool = False) -> list[ConfigError]:
    errs = ranges.check(cfg)  # every field's own range first: the rules below may assume them
    if errs:
        return errs
    path_errs = _paths(cfg)
    if any(isinstance(e, paths.PathProblem) for e in path_errs):  # the OS refuses a path (a name too long, a
        return path_errs                                          # symlink loop): before any reader meets it
    errs = plan_mod.check(cfg.topology) + path_errs
    model_errs = _model(cfg, submitting)
    # what the job's components refuse when they start (vLLM's context, the rope, megatron's scheduler):
    # the job checks the same again before it starts (launcher.driver.start_check)
    errs += model_errs or job_limits.errors(cfg, tokenizer=False)
    errs += _parallel_vs_model(cfg)
    errs += _peft(cfg)
    errs += _refit_and_vllm(cfg)
    errs += _expert_lora(cfg)
    errs += _latent_lora(cfg)
    errs += _hybrid(cfg)
    errs += _lora_not_in_peft(cfg)
    errs += _grpo(cfg)
    errs += _grpo_sampling(cfg)
    errs += _data_and_reward(cfg, submitting)
    errs += _slurm(cfg)
    if cfg.logging.wandb_project:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            errs.append(ConfigError("logging.wandb_project", "wandb is not installed (pip install wandb), "
                                                             "or set logging.wandb_project=null"))
    if not errs:  # last: the memory plan assumes every rule above holds
        errs += memory.check(cfg, plan_mod.build(cfg.topology))
    return errs


def _paths(cfg: Config) -> list[ConfigError]:
    errs = [paths.run_name_error(cfg.run.name)]
    errs += [paths.path_error(key, getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]))
             for key in paths.PATH_KEYS]
    if cfg.resume is not None and not paths.RESUME_WORDS.match(cfg.resume):
        errs.append(paths.path_error("resume", cfg.resume))
    errs = [e for e in errs if e is not None]
    if not errs:  # the OS's own refusals of a path (a name too long, a symlink loop): one line each
        values = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in paths.PATH_KEYS}
        values["run.name"] = f"{cfg.run.root}/{cfg.run.name}"
        if cfg.resume is not None and not paths.RESUME_WORDS.match(cfg.resume):
            values["resume"] = cfg.resume
        for key in ("data.train", "data.validation"):
            values[key] = getattr(cfg.data, key.split(".")[1])
        for key, spec in (("reward.fn", cfg.reward.fn), ("env.fn", cfg.env.fn),
                          *((f"env.tools[{i}]", t) for i, t in enumerate(cfg.env.tools))):
            if spec and ":" in spec:
                values[key] = spec.rpartition(":")[0]
        for key, v in values.items():
            if key == "run.name" and errs:
                continue  # run.root's own problem
            if (e := paths.path_problem(key, v)) is not None:
                errs.append(e)
    return errs


def _model(cfg: Config, submitting: bool) -> list[ConfigError]:
    """The model's facts are resolved (launcher.config.model_facts: from config.json or the built-in
    recipe) before this runs; unresolved (None) ones belong to a dry run for a checkpoint elsewhere.
    What the stack cannot honour of them (launcher.config.model_rules) is one of the job's limits
    (launcher.config.job_limits), checked after these."""
    m = cfg.model
    errs = []
    if m.family is not None and m.family not in model_facts.supported_families():
        errs.append(ConfigError("model.family", f"must be one of {', '.join(model_facts.supported_families())}, "
                                                f"got {m.family!r}"))
    if m.path is None:
        if m.builtin not in BUILTIN_MODELS:
            errs.append(ConfigError("model.builtin", f"with model.path null, must be a built-in recipe: "
                                                     f"{', '.join(sorted(BUILTIN_MODELS))}; got {m.builtin!r}"))
    elif submitting or paths.model_dir(cfg).exists():
        errs += _model_dir(cfg, submitting)
    if m.num_attention_heads and m.num_query_groups and m.num_attention_heads % m.num_query_groups:
        errs.append(ConfigError("model.num_query_groups", f"must divide num_attention_heads = "
                                                          f"{m.num_attention_heads}, got {m.num_query_groups}"))
    return errs


def _model_dir(cfg: Config, submitting: bool) -> list[ConfigError]:
    """A local HF checkpoint: its config.json gave the facts (model_facts.apply, which refused one
    that is unreadable or of an unsupported family), and (submitting: a dry run notes it) everything
    else the run reads from it is there (safetensors weights, a tokenizer: launcher.config.model_files)."""
    path = paths.model_dir(cfg)
    missing = model_files.problem(path)
    if missing is not None and (submitting or not (path / "config.json").is_file()):
        return [ConfigError("model.path", missing)]
    return []


def _parallel_vs_model(cfg: Config) -> list[ConfigError]:
    m, tr, gen = cfg.model, cfg.topology.train, cfg.topology.generation
    errs = []
    if m.num_query_groups and m.num_query_groups % tr.tensor_parallel:
        errs.append(ConfigError("topology.train.tensor_parallel",
                                f"must divide model.num_query_groups = {m.num_query_groups} (a TP rank holds whole "
                                f"query groups), got {tr.tensor_parallel}"))
    if m.num_layers and m.num_layers % tr.pipeline_parallel:
        errs.append(ConfigError("topology.train.pipeline_parallel",
                                f"must divide model.num_layers = {m.num_layers}, got {tr.pipeline_parallel}"))
    if m.num_experts == 0 and tr.expert_parallel != 1:
        errs.append(ConfigError("topology.train.expert_parallel",
                                f"model {m.name} has no experts: must be 1, got {tr.expert_parallel}"))
    elif m.num_experts and m.num_experts % tr.expert_parallel:
        errs.append(ConfigError("topology.train.expert_parallel",
                                f"must divide model.num_experts = {m.num_experts}, got {tr.expert_parallel}"))
    if m.num_attention_heads and m.num_attention_heads % gen.tensor_parallel:
        errs.append(ConfigError("topology.generation.tensor_parallel",
                                f"must divide model.num_attention_heads = {m.num_attention_heads} (vLLM splits "
                                f"heads), got {gen.tensor_parallel}"))
    return errs


def _layer_modules(cfg: Config) -> list[str]:
    mods = LORA_MODULES.get(cfg.model.family or "", ()) + _latent_projections(cfg)
    return [f"decoder.layers.{i}.{mod}" for i in range(cfg.model.num_layers) for mod in mods]


def _latent_projections(cfg: Config) -> tuple[str, ...]:
    """LatentMoE's projections (Nemotron 3: model.family_facts.moe_latent_size), modules of the model that
    LoRA may not wrap (`_latent_lora`)."""
    latent = (cfg.model.family_facts or {}).get("moe_latent_size")
    return ("mlp.fc1_latent_proj", "mlp.fc2_latent_proj") if latent and cfg.model.num_experts else ()


def _latent_lora(cfg: Config) -> list[ConfigError]:
    """No LoRA on LatentMoE's projections: neither half of the stack carries it exactly. Megatron-Bridge's LoRA
    wraps a TE linear (cuda) and a plain torch linear (the CPU stand-in) as different adapters, the refit
    layout and the PEFT exporter map no such module, and vLLM would have to serve it on a replicated linear
    inside its fused MoE layer."""
    mods = _latent_projections(cfg)
    hit = [t for t in cfg.peft.target_modules if any(_matches(t, f"decoder.layers.0.{m}") for m in mods)]
    if not (cfg.peft.enabled and hit):
        return []
    return [ConfigError("peft.target_modules", f"{', '.join(map(repr, hit))} wrap LatentMoE's projections "
                                               f"(fc1_latent_proj, fc2_latent_proj) of {cfg.model.name}: LoRA on "
                                               f"them is not supported (the trainer's adapter, the refit layout, "
                                               f"the PEFT exporter and vLLM do not carry it the same); wrap the "
                                               f"experts' linear_fc1/linear_fc2 or the shared experts instead")]


def _peft(cfg: Config) -> list[ConfigError]:
    """Each of peft.target_modules names a module of the model (their own values: the schema's)."""
    p = cfg.peft
    errs: list[ConfigError] = []
    if not p.enabled or cfg.model.family not in LORA_MODULES or not cfg.model.num_layers:
        return errs  # model.family is reported (or not resolved): its modules are unknown
    names = _layer_modules(cfg)
    short = sorted({n.rsplit(".", 1)[1] for n in names})
    for target in p.target_modules:
        if not any(_matches(target, n) for n in names):
            errs.append(ConfigError("peft.target_modules", f"{target!r} matches no module of model {cfg.model.name} "
                                                           f"({cfg.model.family}); allowed: {', '.join(short)} or "
                                                           f"a pattern like decoder.layers.*.self_attention.linear_qkv"))
    return errs


def _matches(target: str, name: str) -> bool:
    """Megatron-Bridge's rule: a plain name matches the last component, a pattern the full name."""
    import re

    if "." not in target and "*" not in target:
        return name.rsplit(".", 1)[1] == target
    return re.fullmatch(re.escape(target).replace(r"\*", ".*"), name) is not None


# Megatron names of expert linears (grouped GEMM, and SequentialMLP's local experts; mlp or mixer).
_EXPERT_LINEARS = tuple(f"decoder.layers.0.{block}.experts.{local}linear_fc{i}" for block in ("mlp", "mixer")
                        for local in ("", "local_experts.0.") for i in (1, 2))


def _expert_lora(cfg: Config) -> list[ConfigError]:
    """LoRA on experts only where it is exact (docs/moe.md): never silently train one model and
    generate with another."""
    p, ep = cfg.peft, cfg.topology.train.expert_parallel
    if not (p.enabled and cfg.model.num_experts):
        return []
    experts = [t for t in p.target_modules if any(_matches(t, n) for n in _EXPERT_LINEARS)]
    if not experts or (cfg.refit.mode == "merged" and ep == 1):
        return []
    why = ("Megatron-Bridge 0.6.2's merged export merges one rank's expert adapter into every expert at "
           "expert_parallel > 1 (docs/moe.md)" if cfg.refit.mode == "merged" else
           f"refit.mode={cfg.refit.mode} does not carry expert adapters yet")
    return [ConfigError("peft.target_modules", f"{', '.join(map(repr, experts))} wrap the {cfg.model.num_experts} "
                                               f"experts of {cfg.model.name}: LoRA on experts is exact only with "
                                               f"refit.mode=merged at topology.train.expert_parallel=1 ({why}); "
                                               f"LoRA on attention (linear_qkv, linear_proj) works at every "
                                               f"expert_parallel")]


def _hybrid(cfg: Config) -> list[ConfigError]:
    """A hybrid (Mamba) model: each TP rank holds whole Mamba heads and whole groups (megatron's mixer).
    Its facts are the resolved ones (model.family_facts: launcher.config.model_facts)."""
    facts = cfg.model.family_facts or {}
    heads, groups, tp = facts.get("mamba_num_heads"), facts.get("n_groups"), cfg.topology.train.tensor_parallel
    if not heads or not groups:
        return []
    if heads % tp or groups % tp:
        return [ConfigError("topology.train.tensor_parallel",
                            f"must divide the Mamba heads ({heads}) and groups ({groups}) of model "
                            f"{cfg.model.name}, got {tp}")]
    return []


def _lora_not_in_peft(cfg: Config) -> list[ConfigError]:
    """refit.mode=adapter serves a PEFT adapter: only modules a PEFT adapter can hold."""
    p, refused = cfg.peft, LORA_NOT_IN_PEFT.get(cfg.model.family, {})
    if not (p.enabled and refused and cfg.refit.mode == "adapter"):
        return []
    errs = []
    for module, why in refused.items():
        hit = [t for t in p.target_modules if _matches(t, f"decoder.layers.0.{module}")]
        if hit:
            errs.append(ConfigError("peft.target_modules", f"{', '.join(map(repr, hit))} wrap {module} of "
                                                           f"{cfg.model.name}, which refit.mode=adapter cannot serve: "
                                                           f"{why}; use refit.mode=merged or merged_delta, or leave "
                                                           f"it out"))
    return errs


def _refit_and_vllm(cfg: Config) -> list[ConfigError]:
    r, v = cfg.refit, cfg.vllm
    errs = []
    if r.mode != "merged" and not cfg.peft.enabled:
        errs.append(ConfigError("refit.mode", f"{r.mode} sends LoRA factors: needs peft.enabled=true "
                                              f"(full fine-tuning uses refit=merged)"))
    if r.transport == "nccl" and cfg.topology.device != "cuda":
        errs.append(ConfigError("refit.transport", "nccl needs topology.device=cuda; on cpu use auto, ray or gloo"))
    elif r.transport == "ray" and cfg.topology.device == "cuda" and cfg.topology.generation.tensor_parallel > 1:
        errs.append(ConfigError("refit.transport", "ray cannot feed a TP>1 engine on cuda: vLLM's RayExecutorV2 "
                                                   "passes refit specs to its workers through a message queue, "
                                                   "where Ray pins each bucket's object ref for the worker's "
                                                   "lifetime (a leak every refit); use auto (nccl) or gloo"))
    if r.mode == "adapter" and cfg.peft.enabled and cfg.peft.dim > v.max_lora_rank:
        errs.append(ConfigError("vllm.max_lora_rank", f"must be at least peft.dim = {cfg.peft.dim} for "
                                                      f"refit.mode=adapter, got {v.max_lora_rank}"))
    if cfg.grpo.max_total_sequence_length <= cfg.grpo.max_new_tokens:
        errs.append(ConfigError("grpo.max_total_sequence_length", f"must exceed grpo.max_new_tokens = "
                                                                  f"{cfg.grpo.max_new_tokens} (prompt + response), "
                                                                  f"got {cfg.grpo.max_total_sequence_length}"))
    return errs


def _grpo(cfg: Config) -> list[ConfigError]:
    g = cfg.grpo
    errs = []
    tr = cfg.topology.train
    model_par = tr.tensor_parallel * tr.pipeline_parallel * tr.context_parallel
    world = tr.nodes * tr.ranks_per_node
    dp = world // model_par if world % model_par == 0 else 0
    batch = g.num_prompts_per_step * g.num_generations_per_prompt
    if dp and batch % dp:
        errs.append(ConfigError("grpo.num_prompts_per_step", f"prompts x generations = {batch} must divide evenly "
                                                             f"over the {dp} data-parallel trainer groups"))
    errs += loss_errors(g.loss)
    return errs


def _grpo_sampling(cfg: Config) -> list[ConfigError]:
    """Validation and overlong shaping (issue 11) against the data and the response length."""
    g = cfg.grpo
    errs = []
    if (g.val_period or g.val_at_start) and cfg.data.validation is None:
        errs.append(ConfigError("grpo.val_period", "validation needs data.validation=PATH (or a built-in set)"))
    op = g.overlong_penalty
    if op.enabled and cfg.env.fn is not None:
        errs.append(ConfigError("grpo.overlong_penalty.enabled", "is for single-turn samples (a response against "
                                                                 "max_new_tokens); env.fn runs episodes: set it false"))
    if op.buffer_tokens is not None and not 1 <= op.buffer_tokens <= g.max_new_tokens:
        errs.append(ConfigError("grpo.overlong_penalty.buffer_tokens", f"must be in [1, max_new_tokens = "
                                                                       f"{g.max_new_tokens}] or null, got {op.buffer_tokens}"))
    return errs


def _data_and_reward(cfg: Config, submitting: bool) -> list[ConfigError]:
    """The prompt files and the reward function (read / imported when they exist; always when submitting)."""
    from launcher.driver import data, rewards  # torch-free; reads files with pyarrow

    from launcher.driver import environments

    errs = rewards.check(cfg.reward, submitting) + environments.check(cfg, submitting)
    room = cfg.grpo.max_total_sequence_length - cfg.grpo.max_new_tokens
    if cfg.data.max_prompt_tokens is not None and cfg.data.max_prompt_tokens > room > 0:
        errs.append(ConfigError("data.max_prompt_tokens", f"must be at most max_total_sequence_length - "
                                                          f"max_new_tokens = {room}, got {cfg.data.max_prompt_tokens}"))
    data_errs = data.check(cfg.data, need_answer=cfg.reward.fn in rewards.BUILTIN, submitting=submitting,
                           need_prompt=cfg.env.fn is None)  # an environment reads what it needs itself
    # the tokenizer's chat template for data.messages_key (one of the job's limits), once the file has the field
    return errs + (data_errs or job_limits.chat_template(cfg))


def _slurm(cfg: Config) -> list[ConfigError]:
    s = cfg.slurm
    errs = []
    if s.signal_delay_s < 0 or s.signal_delay_s >= s.time_min * 60:
        errs.append(ConfigError("slurm.signal_delay_s", f"must be in [0, time_min*60) = [0, {s.time_min * 60}), "
                                                        f"got {s.signal_delay_s}"))
    return errs
