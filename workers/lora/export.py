"""A trainer checkpoint's LoRA factors -> an HF PEFT adapter directory, checked against the base model.

`export_adapter(trainer_dir, out, base, ...)` is the worker side of `python -m launcher.export`
(which finds the run checkpoint, its config and the base model, and prints the result):
  factors   `workers.lora.checkpoint` reads the LoRA entries of the DCP in `trainer_dir` only
            (no model, no process group, no base weights)
  layout    `workers.lora.layout`: Megatron module -> HF modules from Megatron-Bridge's registry,
            fused QKV LoRA-B split per query group, gated fc1 -> gate/up; `workers.lora.peft` writes
  names     every HF module is spelled as the base checkpoint's safetensors name it (Nemotron-H:
            `backbone.layers.N.mixer.*` or `model.layers.N.mixer.*`) and its [out, in] must equal
            the base weight's shape: an adapter naming modules the base lacks would load into vLLM
            without error and change nothing, so that is refused here
  complete  an adapter with a module PEFT cannot attach (schema.LORA_NOT_IN_PEFT: a Mamba out_proj)
            is refused whole rather than written without it
Every refusal is an ExportError of one line. torch is imported only once the checkpoint and the
base model have passed the cheap checks (the CLI that imports this module stays torch-free).
"""

from __future__ import annotations

import json
import logging
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from workers.lora import checkpoint as lora_checkpoint


class ExportError(Exception):
    """The adapter cannot be exported (one line: what and why)."""


@dataclass
class AdapterExport:
    out: Path
    megatron_modules: int
    hf_modules: int
    tensors: int
    target_modules: list[str]
    bytes_read: int
    checkpoint_bytes: int
    skipped: dict[str, list[str]] = field(default_factory=dict)


def export_adapter(trainer_dir: Path, out: str | Path, base: Path, *, facts, dim: int, alpha: float,
                   peft_enabled: bool, config_file: Path) -> AdapterExport:
    """Write the LoRA adapter in `trainer_dir` (a trainer save_state) as HF PEFT files in `out`.

    `base` is the resolved HF base model directory, `facts` the run's model facts
    (launcher.config.model_facts.ModelFacts: the layout); dim/alpha/peft_enabled come from the
    run's config, `config_file`, which the messages name.
    """
    from workers import hf_checkpoint  # torch from here on
    from workers.lora import layout as lora_layout, peft

    try:
        layout = lora_layout.ModelLayout.from_facts(facts)
    except ValueError as e:
        raise ExportError(f"{config_file}: {e}") from None

    found = lora_checkpoint.scan(trainer_dir)
    if not found.lora:
        raise ExportError(f"{found.directory}: no LoRA adapter tensors (*.adapter.linear_in/linear_out) in the "
                          f"checkpoint (the run had peft.enabled={str(peft_enabled).lower()}); nothing to export")
    state, bytes_read = lora_checkpoint.load_lora(found)
    try:
        factors = lora_layout.megatron_lora_modules(state)
    except (ValueError, NotImplementedError) as e:
        raise ExportError(str(e)) from None
    for module, (a, _) in factors.items():
        if a.shape[0] != dim:
            raise ExportError(f"rank mismatch: {module} has LoRA rank {a.shape[0]} but {config_file} "
                              f"says peft.dim={dim}")
    _refuse_not_in_peft(factors, layout.family, config_file)
    with _quiet_megatron():  # its import logs Transformer Engine/Apex fallbacks (with tracebacks) at INFO
        for module in factors:
            try:
                lora_layout.module_map(layout.family, module)
            except KeyError:
                raise ExportError(f"unknown module {module}: Megatron-Bridge's {layout.family} mapping has no HF "
                                  "module for it") from None
            except NotImplementedError as e:  # e.g. Mamba in_proj: one Megatron weight, several HF parts
                raise ExportError(f"unsupported module {module}: {e}") from None
        hf_groups = lora_layout.hf_lora_groups(layout, state)
    shapes = hf_checkpoint.weight_shapes(base)
    if not shapes:
        raise ExportError(f"{base}: no *.safetensors files to check module names against")
    groups = [_spelled_as_base(g, layout.family, base, shapes) for g in hf_groups]

    out = Path(out).expanduser()
    peft.write_peft_adapter(out, groups, dim, alpha, base_model_name_or_path=str(base),
                            exclude_modules=_not_in_adapter(groups, shapes))
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    hf_modules = sum(len(g.hf_modules) for g in groups)
    return AdapterExport(out=out.resolve(), megatron_modules=len(groups), hf_modules=hf_modules,
                         tensors=2 * hf_modules, target_modules=adapter_config["target_modules"],
                         bytes_read=bytes_read, checkpoint_bytes=found.total_bytes, skipped=found.skipped)


def _not_in_adapter(groups, shapes: dict[str, list[int]]) -> list[str]:
    """Linears of the base that the adapter's target_modules (last name parts) also name but the adapter
    has no factors for (Nemotron-H: a shared expert's up_proj next to an MLP layer's), spelled from
    `layers.` on so that PEFT's suffix match finds them under `backbone.` and `model.` alike."""
    held = {m for g in groups for m in g.hf_modules}
    suffixes = {m.rsplit(".", 1)[-1] for m in held}
    # routed experts (`.experts.N.` on disk) are one fused parameter per layer in transformers 5, not
    # Linear modules PEFT could wrap (naming them only makes PEFT warn that nothing was excluded); a
    # Nemotron 3 checkpoint's MTP layers (`mtp.layers.N.`) are no module of transformers' model at all (and
    # vLLM's LoRA skips them), and spelled from `layers.` on they would exclude the stack's own layer N
    others = {name[: -len(".weight")] for name, shape in shapes.items()
              if name.endswith(".weight") and len(shape) == 2 and ".experts." not in name
              and not name.startswith("mtp.")} - held
    return sorted(m[m.find("layers."):] if "layers." in m else m
                  for m in others if m.rsplit(".", 1)[-1] in suffixes)


def _refuse_not_in_peft(factors, family: str, config_file: Path) -> None:
    """An adapter PEFT cannot attach whole is not written (launcher.config.schema.LORA_NOT_IN_PEFT)."""
    from launcher.config.schema import LORA_NOT_IN_PEFT

    for refused, why in LORA_NOT_IN_PEFT.get(family, {}).items():
        hit = [m for m in factors if m.endswith("." + refused)]
        if hit:
            raise ExportError(f"the checkpoint has LoRA on {refused} ({hit[0]}{' and more' if len(hit) > 1 else ''}), "
                              f"which an HF PEFT adapter cannot hold: {why}; the run ({config_file}) can only "
                              f"serve it through its merged refit modes")


@contextmanager
def _quiet_megatron():
    """Megatron's imports log fallbacks at INFO from loggers with their own levels and handlers."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


def _spelled_as_base(group, family: str, base: Path, shapes: dict[str, list[int]]):
    """`group` with each HF module named as the base checkpoint names it; shapes checked against it."""
    from workers.lora.layout import HfLoraGroup, hf_name_candidates

    names = []
    for module, b in zip(group.hf_modules, group.lora_b):
        spellings = hf_name_candidates(module, family)
        spelled = next((s for s in spellings if f"{s}.weight" in shapes), None)
        if spelled is None:
            raise ExportError(f"{group.megatron_module} -> {module}: the base checkpoint {base} has no weight "
                              f"{' or '.join(s + '.weight' for s in spellings)}")
        want = [int(b.shape[0]), int(group.lora_a.shape[1])]
        if list(shapes[f"{spelled}.weight"]) != want:
            raise ExportError(f"{group.megatron_module} -> {spelled}: LoRA gives [out, in] = {want} but the base "
                              f"weight is {list(shapes[spelled + '.weight'])} (a different base model?)")
        names.append(spelled)
    return HfLoraGroup(group.megatron_module, tuple(names), group.lora_a, group.lora_b)
