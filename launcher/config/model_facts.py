"""A checkpoint is the source of its own architecture: model facts read from its config.json.

With `model.path` pointing at a local HF checkpoint, `apply(raw)` replaces the architecture numbers
of the `model:` section (family, num_layers, hidden_size, num_attention_heads, num_query_groups,
head_dim, num_experts, moe_router_topk) by what the checkpoint's config.json says, and returns one
note per number the conf had differently (a disagreement is a note, not an error). The numbers in
conf/model/*.yaml only serve dry runs for a checkpoint that is not on this machine.

The family is HF's `model_type`. It is supported when (a) Megatron-Bridge registers a bridge for
one of the checkpoint's `architectures` and (b) our LoRA layout knows the family
(launcher.config.schema.LORA_MODULES, the Megatron modules LoRA may wrap per family).

(a) is read statically: the launcher must stay torch-free and fast (a dry run plans for a cluster
and imports neither torch nor megatron), so instead of importing megatron.bridge (seconds, and
torch) we parse the installed Megatron-Bridge's sources (`ast`, about 0.25 s, cached) for its own
registrations, `@MegatronModelBridge.register_bridge(source=..., model_type=...)` and
`register_bridge_implementation(source=...)`: the same calls that fill the dispatch table
`AutoBridge` looks the architecture up in. The trainer then dispatches through the real
registry (AutoBridge.from_hf_pretrained); a registration this reading missed would fail there.
Where Megatron-Bridge is not installed (a laptop planning a cluster run), (a) is not checked.

Robust reading: a config.json that is not a JSON object, a missing key or a value of the wrong
type is one ConfigError naming the file and the key.

Hybrid models (Nemotron-H) have more facts, `hybrid_facts` (at the end of this module): the layer
pattern (which also counts the layers, and has experts only where it has E layers), Mamba heads,
groups and state, shared experts. Validation reads them from the checkpoint or the built-in recipe.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from launcher.config.schema import FAMILIES, ConfigError

# The model: keys filled from config.json, and the HF keys they come from. HF names differ per
# family for the expert numbers; these are the names Megatron-Bridge's CONFIG_MAPPING reads.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")


@dataclass(frozen=True)
class ModelFacts:
    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    num_experts: int
    moe_router_topk: int


FACT_KEYS = tuple(f.name for f in fields(ModelFacts))


def read(path: str | Path) -> tuple[ModelFacts, list[str]]:
    """(facts, architectures) of the HF checkpoint directory `path`; ConfigError on a bad config.json."""
    cfg_file = Path(path) / "config.json"
    try:
        hf = json.loads(cfg_file.read_text())
    except OSError as e:
        raise ConfigError("model.path", f"cannot read {cfg_file}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError("model.path", f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError("model.path", f"{cfg_file} must hold a JSON object, got {type(hf).__name__}")
    reader = _Reader(hf, cfg_file)
    family = reader.string("model_type")
    architectures = hf.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ConfigError("model.path", f"{cfg_file}: architectures must be a list of strings, "
                                        f"got {architectures!r}")
    heads = reader.positive("num_attention_heads")
    hidden = reader.positive("hidden_size")
    groups = reader.positive("num_key_value_heads", default=heads)
    if hf.get("head_dim") is None and hidden % heads:
        raise ConfigError("model.path", f"{cfg_file}: has no head_dim and hidden_size {hidden} is not a "
                                        f"multiple of num_attention_heads {heads}")
    head_dim = reader.positive("head_dim", default=hidden // heads)
    if heads % groups:
        raise ConfigError("model.path", f"{cfg_file}: num_key_value_heads {groups} must divide "
                                        f"num_attention_heads {heads}")
    experts = reader.first_count(EXPERT_KEYS)
    topk = reader.first_count(TOPK_KEYS) if experts else 0
    hybrid = hybrid_facts(hf, cfg_file)
    if hybrid is not None:  # experts exist only where its layer pattern has E layers
        experts, topk = hybrid.num_experts, hybrid.moe_router_topk
    if experts and not 1 <= topk <= experts:
        raise ConfigError("model.path", f"{cfg_file}: an MoE model needs num_experts_per_tok in "
                                        f"[1, {experts}], got {topk}")
    # hybrid models (Nemotron-H in transformers 5) list their blocks instead of counting them
    blocks = hf.get("layers_block_type")
    layers = (len(blocks) if isinstance(blocks, list) and blocks and hf.get("num_hidden_layers") is None
              else reader.positive("num_hidden_layers"))
    if hybrid is not None:  # its pattern counts the layers
        layers = len(hybrid.pattern)
    facts = ModelFacts(family=family, num_layers=layers, hidden_size=hidden,
                       num_attention_heads=heads, num_query_groups=groups, head_dim=head_dim,
                       num_experts=experts, moe_router_topk=topk)
    return facts, architectures


class _Reader:
    def __init__(self, hf: dict, cfg_file: Path):
        self.hf, self.cfg_file = hf, cfg_file

    def _error(self, key: str, what: str) -> ConfigError:
        return ConfigError("model.path", f"{self.cfg_file}: {key} {what}")

    def string(self, key: str) -> str:
        value = self.hf.get(key)
        if value is None:
            raise self._error(key, "is missing (a transformers config.json names its model_type)")
        if not isinstance(value, str) or not value:
            raise self._error(key, f"must be a non-empty string, got {value!r}")
        return value

    def positive(self, key: str, default: Optional[int] = None) -> int:
        value = self.hf.get(key)
        if value is None:
            if default is None:
                raise self._error(key, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self._error(key, f"must be a positive integer, got {value!r}")
        return value

    def first_count(self, keys: tuple[str, ...]) -> int:
        """The first of `keys` present (0 when none is, or it is null): a count, 0 or more."""
        for key in keys:
            value = self.hf.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise self._error(key, f"must be an integer >= 0, got {value!r}")
            return value
        return 0


# ------------------------------------------------------------------------------------------
# Megatron-Bridge's registry, read from its sources (no import)


@dataclass(frozen=True)
class Registration:
    architecture: str            # e.g. Qwen3MoeForCausalLM
    model_type: Optional[str]    # as given to register_bridge (None for some, e.g. Mistral)
    module: str                  # megatron.bridge.models.qwen.qwen3_moe_bridge


@lru_cache(maxsize=1)
def bridge_registrations() -> Optional[tuple[Registration, ...]]:
    """Every (architecture, model_type) Megatron-Bridge registers, or None where it is not installed."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("megatron")  # a namespace package: nothing is executed
    except (ImportError, ValueError):
        return None
    roots = [Path(p) / "bridge" for p in (spec.submodule_search_locations or [])] if spec else []
    roots = [r for r in roots if r.is_dir()]
    if not roots:
        return None
    out = []
    for root in roots:
        for file in sorted(root.rglob("*.py")):
            text = file.read_text(errors="replace")
            if "register_bridge" in text:
                module = "megatron.bridge." + ".".join(file.relative_to(root).with_suffix("").parts)
                out += _registrations_in(text, module)
    return tuple(out)


def _registrations_in(text: str, module: str) -> list[Registration]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    constants = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}

    def name_of(value: ast.AST) -> Optional[str]:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
        if isinstance(value, ast.Name):
            return constants.get(value.id, value.id)  # a class imported from transformers, or a constant
        if isinstance(value, ast.Attribute):
            return value.attr
        return None

    out = []
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        called = getattr(func, "attr", None) or getattr(func, "id", None)
        if not isinstance(node, ast.Call) or called not in ("register_bridge", "register_bridge_implementation"):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        arch = name_of(kw["source"]) if "source" in kw else None
        if not arch or arch == "source" or arch.startswith("_"):
            continue  # the definition of register_bridge itself, or a value computed at run time
        model_type = name_of(kw["model_type"]) if "model_type" in kw else None
        out.append(Registration(arch, model_type, module))
    return out


def bridge_architectures() -> Optional[set[str]]:
    regs = bridge_registrations()
    return None if regs is None else {r.architecture for r in regs}


# ------------------------------------------------------------------------------------------
# the supported families, and the config


def lora_families() -> tuple[str, ...]:
    return tuple(FAMILIES)


def supported_families() -> tuple[str, ...]:
    """Families our LoRA layout knows that Megatron-Bridge registers (all of ours where it is absent)."""
    regs = bridge_registrations()
    if regs is None:
        return lora_families()
    bridged = {r.model_type for r in regs} | {_family_of_architecture(r.architecture) for r in regs}
    return tuple(f for f in lora_families() if f in bridged)


def _family_of_architecture(arch: str) -> str:
    """MistralForCausalLM -> mistral (for registrations without model_type): lower-case, CamelCase -> _."""
    import re

    base = re.sub(r"(ForCausalLM|ForConditionalGeneration)$", "", arch)
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()


def check_supported(facts: ModelFacts, architectures: list[str], where: str) -> None:
    """One ConfigError naming the supported families when the bridge or our LoRA layout lacks this one."""
    supported = ", ".join(supported_families())
    known = bridge_architectures()
    if known is not None and not any(a in known for a in architectures):
        shown = ", ".join(architectures) or "no architectures"
        raise ConfigError("model.path", f"{where} is {facts.family} ({shown}): Megatron-Bridge has no bridge for "
                                        f"it; supported families: {supported}")
    if facts.family not in lora_families():
        raise ConfigError("model.path", f"{where} is model_type {facts.family!r}: no LoRA layout for it; "
                                        f"supported families: {supported}")


def apply(raw: Any) -> list[str]:
    """Fill raw.model (a DictConfig) from model.path's config.json when it is here; return the notes."""
    model = raw.get("model") if hasattr(raw, "get") else None
    path = model.get("path") if model is not None else None
    if not path or not (Path(str(path)) / "config.json").is_file():
        return []
    facts, architectures = read(str(path))
    where = f"{path}/config.json"
    check_supported(facts, architectures, where)
    from omegaconf import open_dict

    differ = []
    with open_dict(model):
        for key in FACT_KEYS:
            value = getattr(facts, key)
            conf = model.get(key)
            if conf is not None and conf != value:
                differ.append(f"{key}={value} (conf: {conf})")
            model[key] = value
    return [f"model: {where} says {', '.join(differ)}; using the checkpoint's numbers"] if differ else []


# ------------------------------------------------------------------------------------------
# hybrid (Nemotron-H) facts: the layer pattern, Mamba sizes, experts


# Layer kinds of a hybrid pattern (megatron's symbols, Nemotron-H's hybrid_override_pattern), and the
# names transformers 5 writes in layers_block_type instead (with their older spellings)
HYBRID_SYMBOLS = {"M": "Mamba-2", "*": "attention", "-": "MLP", "E": "MoE"}
_BLOCK_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                  "moe": "E"}


@dataclass(frozen=True)
class HybridFacts:
    pattern: str               # one symbol per layer (HYBRID_SYMBOLS), e.g. "M*EM*-"
    mamba_num_heads: int
    mamba_head_dim: int
    mamba_num_groups: int      # n_groups: B and C are shared by the heads of a group
    mamba_state_dim: int
    num_experts: int           # routed experts of each E layer; 0 without E layers
    moe_router_topk: int
    num_shared_experts: int


def hybrid_pattern(hf: dict, cfg_file: Path | str = "config.json") -> Optional[str]:
    """A hybrid checkpoint's layer pattern: `hybrid_override_pattern` (published Nemotron-H configs) or
    `layers_block_type` (as transformers 5 writes them); None for other models. ConfigError when
    malformed."""
    reader = _Reader(hf, Path(cfg_file))
    pattern, blocks = hf.get("hybrid_override_pattern"), hf.get("layers_block_type")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(HYBRID_SYMBOLS):
            raise reader._error("hybrid_override_pattern", f"must be a string of {''.join(HYBRID_SYMBOLS)} "
                                                           f"(one per layer), got {pattern!r}")
        return pattern
    if blocks is None or hf.get("model_type") != "nemotron_h":
        return None
    if not isinstance(blocks, list) or not blocks or not all(b in _BLOCK_SYMBOLS for b in blocks):
        raise reader._error("layers_block_type", f"must be a list of {', '.join(sorted(_BLOCK_SYMBOLS))}, "
                                                 f"got {blocks!r}")
    return "".join(_BLOCK_SYMBOLS[b] for b in blocks)


def hybrid_facts(hf: dict, cfg_file: Path | str = "config.json") -> Optional[HybridFacts]:
    """The hybrid facts of a config.json's content (or of a built-in recipe: its keys are HF's); None
    for a model without a hybrid layer pattern."""
    pattern = hybrid_pattern(hf, cfg_file)
    if pattern is None:
        return None
    reader = _Reader(hf, Path(cfg_file))
    heads = reader.positive("mamba_num_heads") if "M" in pattern else 0
    groups = reader.positive("n_groups", default=1) if heads else 0
    if heads and heads % groups:
        raise reader._error("n_groups", f"{groups} must divide mamba_num_heads {heads}")
    experts = reader.first_count(EXPERT_KEYS) if "E" in pattern else 0
    topk = reader.first_count(TOPK_KEYS) if experts else 0
    if "E" in pattern and not 1 <= topk <= experts:
        raise reader._error("num_experts_per_tok", f"must be in [1, n_routed_experts = {experts}] for the E layers "
                                                   f"of {pattern!r}, got {topk}")
    return HybridFacts(pattern=pattern, mamba_num_heads=heads,
                       mamba_head_dim=reader.positive("mamba_head_dim") if heads else 0,
                       mamba_num_groups=groups, mamba_state_dim=reader.positive("ssm_state_size") if heads else 0,
                       num_experts=experts, moe_router_topk=topk,
                       num_shared_experts=reader.first_count(("n_shared_experts",)) if experts else 0)


def hybrid_facts_of(path: str | Path) -> Optional[HybridFacts]:
    """hybrid_facts of the checkpoint directory `path` (its config.json; read() has checked it)."""
    cfg_file = Path(path) / "config.json"
    return hybrid_facts(json.loads(cfg_file.read_text()), cfg_file)
