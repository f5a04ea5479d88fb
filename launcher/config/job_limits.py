"""What the job's components refuse when they start, computed from the config alone, without torch.

A run that the launcher accepts must be one the job can start: otherwise it fails on the cluster
after its wait in the queue. The job's components check things of their own when they start, and
each such check is mirrored here, with the component's numbers, so that the launcher finds the
same problem at submission (launcher.config.validate) and the job finds it again before Ray and
the actors start (launcher.driver.start_check, which also holds the resume checks):

  vLLM's engine      the context (vllm.max_model_len, which grpo.max_total_sequence_length sets) at
                     most the model's positions, derived as vLLM derives them
                     (vllm/transformers_utils/model_arch_config_convertor.py: the smallest of the
                     config's length keys, `model_max_length` over them; scaled by the rope factor
                     for the types vLLM scales: vllm/config/model.py _get_and_verify_max_len)
  the model's rope   what megatron-core and vLLM both compute (launcher.config.model_rules, which
                     also refuses parameters of the wrong type and values neither can build)
  the tokenizer      a chat template where data.messages_key needs one (the driver's PromptEncoder)
  megatron's         the arguments of OptimizerParamScheduler (`scheduler_args`, which the trainer
  scheduler          builds it from) and the asserts of its constructor: decay steps > 0, warm-up
                     shorter than the decay, a WSD style needs WSD decay steps (not set here)

Sampling (vLLM raises a temperature under 0.01 to 0.01 while the trainer divides by the one it
was given) and the timeouts (a timedelta must hold them) are field ranges in launcher.config.schema:
they are checked with every field, also on the config.yaml the job reads. tests/unit/test_job_limits.py
checks each rule against the component itself (vLLM's own functions, megatron's scheduler).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.config import model_rules
from launcher.config.schema import Config, ConfigError, Optim

# vLLM's keys for a model's context length, smallest wins (ModelArchConfigConvertorBase.derive_max_model_len_and_key)
VLLM_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                    "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# rope types whose max_position_embeddings vLLM does not scale by the factor (_get_and_verify_max_len)
VLLM_UNSCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def errors(cfg: Config, tokenizer: bool = True) -> list[ConfigError]:
    """What vLLM's engine, the rope, megatron's scheduler and (`tokenizer`) the tokenizer would refuse in
    the job (validate asks for the tokenizer's after the data file's own checks)."""
    rules = model_rules.errors(cfg.model, cfg.topology.device)
    if cfg.run.job != "grpo":  # placement_smoke, hold, preflight: no engine, no trainer, no prompts
        return rules
    return rules + positions(cfg) + schedule_errors(cfg) + (chat_template(cfg) + template_compiles(cfg)
                                                            if tokenizer else [])


# ------------------------------------------------------------------------------- the tokenizer
# where a tokenizer saved by transformers keeps its chat template (5.x: a file of its own; 4.x: the config)
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def has_chat_template(model_dir: Path) -> bool | None:
    """Whether the tokenizer in `model_dir` has a chat template; None when the folder is not here."""
    from launcher.config import bounded

    if not model_dir.is_dir():
        return None
    if any((model_dir / f).is_file() for f in CHAT_TEMPLATE_FILES) \
            or (model_dir / "additional_chat_templates").is_dir():
        return True
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return False
    return bool(bounded.model_json(config, "tokenizer", obj=True).get("chat_template"))


def chat_template(cfg: Config) -> list[ConfigError]:
    """data.messages_key encodes each record's messages with the tokenizer's chat template
    (launcher.driver.data.PromptEncoder), and env.fn renders an episode's messages with it
    (launcher.driver.episode_tokens): the job refuses a tokenizer without one."""
    from launcher.config.schema import CHAT_RECIPES

    key = "env.fn" if cfg.env.fn is not None else "data.messages_key"
    if not (cfg.data.messages_key or cfg.env.fn) or cfg.run.job != "grpo":
        return []
    why = None
    if cfg.data.chat_template != "auto":
        why = f"data.chat_template={cfg.data.chat_template} turns it off"
    elif cfg.model.path is None:
        if cfg.model.builtin not in CHAT_RECIPES:
            why = f"the built-in model {cfg.model.builtin} has none (model={'/'.join(CHAT_RECIPES)} has one)"
    elif has_chat_template(Path(cfg.model.path)) is False:
        why = f"the tokenizer in {cfg.model.path} has none (no chat_template in tokenizer_config.json, no " \
              f"{' or '.join(CHAT_TEMPLATE_FILES)})"
    if why is None:
        return []
    if key == "env.fn":
        return [ConfigError(key, f"needs the tokenizer's chat template to render the episodes' messages, and {why}")]
    return [ConfigError(key, f"needs the tokenizer's chat template to encode the messages, and {why}; "
                             f"use data.prompt_key")]


def default_template(model_dir: Path) -> tuple[str, Path] | None:
    """(the chat template the job renders with, the file it is in), as transformers picks it when it
    loads the tokenizer (PreTrainedTokenizerBase.from_pretrained, apply_chat_template): the file
    chat_template.jinja, else additional_chat_templates/default.jinja, else tokenizer_config.json's
    `chat_template` (a string, or the entry named "default" of a list of {name, template}), else
    chat_template.json's; None when there is none."""
    from launcher.config import bounded

    limit = bounded.LIMITS["tokenizer"]
    for f in (model_dir / "chat_template.jinja", model_dir / "additional_chat_templates" / "default.jinja"):
        if f.is_file():
            return bounded.read_text(f, limit, "tokenizer"), f
    for f in (model_dir / "tokenizer_config.json", model_dir / "chat_template.json"):
        if f.is_file():
            found = bounded.model_json(f, "tokenizer", obj=True).get("chat_template")
            if isinstance(found, list):
                found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"),
                             None)
            if isinstance(found, str) and found:
                return found, f
    return None


def template_compiles(cfg: Config) -> list[ConfigError]:
    """The job renders every prompt with the tokenizer's chat template when data.chat_template=auto
    (launcher.driver.data.PromptEncoder, episode_tokens): it is compiled here by transformers' own
    compiler (the sandboxed Jinja environment and extensions apply_chat_template uses), so a syntax
    error is one line at submission, not a failure of the job's first step."""
    if cfg.run.job != "grpo" or cfg.data.chat_template != "auto" or cfg.model.path is None \
            or not Path(cfg.model.path).is_dir():
        return []
    from launcher.config import bounded

    try:
        found = default_template(Path(cfg.model.path))
    except bounded.FileError:
        return []  # a file the model folder's own check names (launcher.config.model_files)
    if found is None:
        return []
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template  # what apply_chat_template calls

    template, where = found
    try:
        _compile_jinja_template(template)
    except TemplateError as e:
        line = f", line {e.lineno}" if getattr(e, "lineno", None) else ""
        return [ConfigError("model.path", f"{where}: the chat template does not compile (Jinja: "
                                          f"{str(e.message or e).splitlines()[0][:100]}{line}); the job renders "
                                          f"every prompt with it (or set data.chat_template=none)")]
    return []


# ------------------------------------------------------------------------------- vLLM's context
def model_positions(cfg: Config) -> tuple[float, str] | None:
    """(the longest context vLLM accepts for the run's model, where that comes from), or None when
    the facts are not resolved (a dry run for a checkpoint elsewhere); ConfigError('model.path') for
    a length key that is not a number."""
    from launcher.config import bounded

    config_json = Path(cfg.model.path) / "config.json" if cfg.model.path else None
    if config_json is not None and config_json.is_file():
        hf = bounded.model_json(config_json, "model config", obj=True)
        where = str(config_json)
    elif cfg.model.max_position_embeddings:
        hf, where = {"max_position_embeddings": cfg.model.max_position_embeddings}, f"model {cfg.model.name}"
    else:
        return None
    for k in VLLM_LENGTH_KEYS:  # vLLM compares each one given with a number (a string was a TypeError there)
        if hf.get(k) is not None and _number(hf[k]) is None:
            raise ConfigError("model.path", f"{where}: {k} must be a number (vLLM takes the model's context "
                                            f"length from it), got {str(hf[k])[:40]!r}")
    found = [(hf[k], k) for k in VLLM_LENGTH_KEYS if _number(hf.get(k)) is not None]
    if isinstance(hf.get("model_max_length"), (int, float)) and not isinstance(hf["model_max_length"], bool) \
            and hf["model_max_length"]:
        found = [(hf["model_max_length"], "model_max_length")]
    if not found:
        return None  # vLLM then takes vllm.max_model_len as given
    length, key = min(found)
    rope = cfg.model.rope_scaling or {}
    factor = _number(rope.get("factor"))
    if rope and rope.get("rope_type") not in VLLM_UNSCALED_ROPE and factor is not None:
        length, key = length * factor, f"{key} x rope factor {factor:g}"
    return float(length), f"{key} of {where}"


def _number(v: Any) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def positions(cfg: Config) -> list[ConfigError]:
    try:
        found = model_positions(cfg)
    except ConfigError as e:  # a length key of the wrong type, a config.json that no longer reads
        return [e]
    if found is None or cfg.vllm.max_model_len <= found[0]:
        return []
    limit, where = found
    key = "grpo.max_total_sequence_length" if cfg.vllm.max_model_len == cfg.grpo.max_total_sequence_length \
        else "vllm.max_model_len"
    value = getattr(cfg.grpo if key.startswith("grpo") else cfg.vllm, key.split(".")[1])
    return [ConfigError(key, f"must be at most the model's {limit:g} positions ({where}; vLLM refuses a longer "
                             f"context at engine start), got {value}")]


# --------------------------------------------------------------------------- megatron's scheduler
def decay_steps(optim: Optim, max_num_steps: int) -> int:
    return optim.lr_decay_iters or max_num_steps


def scheduler_args(optim: Optim, max_num_steps: int) -> dict:
    """megatron-core OptimizerParamScheduler's arguments (besides the optimizer) for a run's optim
    section: what workers.trainer.build.make_scheduler builds and what a resume must continue."""
    steps = decay_steps(optim, max_num_steps)
    return dict(init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr, lr_warmup_steps=optim.lr_warmup_iters,
                lr_decay_steps=steps, lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay,
                end_wd=optim.weight_decay, wd_incr_steps=steps, wd_incr_style="constant",
                use_checkpoint_opt_param_scheduler=False,
                override_opt_param_scheduler=optim.override_opt_param_scheduler)


# what load_state_dict compares (OptimizerParamScheduler._check_and_set), and the key that sets each
SCHEDULE_KEYS = {"max_lr": "optim.lr", "min_lr": "optim.min_lr", "lr_warmup_steps": "optim.lr_warmup_iters",
                 "lr_decay_steps": "optim.lr_decay_iters", "lr_decay_style": "optim.lr_decay_style",
                 "start_wd": "optim.weight_decay", "end_wd": "optim.weight_decay",
                 "wd_incr_steps": "optim.lr_decay_iters", "wd_incr_style": "optim.lr_decay_style"}


def schedule_errors(cfg: Config) -> list[ConfigError]:
    """The asserts of OptimizerParamScheduler's constructor, on this run's arguments."""
    a = scheduler_args(cfg.optim, cfg.grpo.max_num_steps)
    if a["lr_decay_style"] == "WSD":
        return [ConfigError("optim.lr_decay_style", "WSD needs megatron's wsd_decay_steps, which this launcher does "
                                                    "not set: use constant, linear, cosine or inverse-square-root")]
    if not a["lr_warmup_steps"] < a["lr_decay_steps"]:
        key = "optim.lr_decay_iters" if cfg.optim.lr_decay_iters else "grpo.max_num_steps"
        return [ConfigError("optim.lr_warmup_iters", f"must be less than the decay steps ({key} = "
                                                     f"{a['lr_decay_steps']}): megatron's scheduler refuses a warm-up "
                                                     f"as long as the decay, got {a['lr_warmup_steps']}")]
    return []


def schedule_changes(saved: Config, now: Config) -> list[tuple[str, Any, Any]]:
    """(the key, its value in `saved`, in `now`) for each scheduler value a resume from a checkpoint of
    `saved` would change (megatron's load_state_dict refuses them unless
    optim.override_opt_param_scheduler); [] when it continues the schedule."""
    if now.optim.override_opt_param_scheduler:
        return []
    before = scheduler_args(saved.optim, saved.grpo.max_num_steps)
    after = scheduler_args(now.optim, now.grpo.max_num_steps)
    out: list[tuple[str, Any, Any]] = []
    for arg, key in SCHEDULE_KEYS.items():
        if arg in ("lr_decay_steps", "wd_incr_steps") and not now.optim.lr_decay_iters:
            key = "grpo.max_num_steps"  # optim.lr_decay_iters null: the decay steps
        if before[arg] != after[arg] and key not in [k for k, _, _ in out]:
            out.append((key, before[arg], after[arg]))
    return out
