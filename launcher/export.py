"""`python -m launcher.export --checkpoint RUN/checkpoints/step_N --out DIR [--base-model PATH] [--name NAME]`

Post-training adapter serving: writes a run checkpoint's LoRA adapter as an HF PEFT adapter
(`adapter_model.safetensors` + `adapter_config.json`) that `PeftModel.from_pretrained` and
`vllm serve BASE --enable-lora --lora-modules NAME=DIR` load. During training the generators get
merged weights instead (refit); this is for serving the result.

What it does, and where each fact lives:
  checkpoint   `launcher.driver.checkpoints.verify` (complete step_N), `config.yaml` read with the launcher's
               own schema (peft.dim / alpha, model.*), `trainer/` read by `workers.lora_checkpoint`
               (LoRA entries only, from the DCP metadata; no model, no process group, no base weights)
  base model   `--base-model`, else `launcher.paths.model_dir(config)`; its config.json gives the
               attention shapes (heads, KV heads, head_dim; heads * head_dim may differ from hidden)
  layout       `workers.lora_layout`: Megatron module -> HF modules from Megatron-Bridge's registry,
               fused QKV LoRA-B split per query group, gated fc1 -> gate/up, PEFT writer
  names        every HF module is spelled as the base checkpoint's safetensors name it (Nemotron-H:
               `backbone.layers.N.mixer.*` or `model.layers.N.mixer.*`) and its [out, in] must equal
               the base weight's shape: an adapter naming modules the base lacks would load into vLLM
               without error and change nothing, so that is refused here
Mistakes (missing/incomplete checkpoint, no adapters, rank mismatch, unknown module, wrong base) are
one line on stderr, exit code 2. This module imports no torch at import time (the launcher's rule).
"""

from __future__ import annotations

import argparse
import json
import logging
import struct
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from launcher import paths
from launcher.driver import checkpoints
from launcher.config import compose as config_mod
from launcher.config.compose import ConfigError
from launcher.config.schema import typed
from launcher.config.validate import VLLM_LORA_RANKS


class ExportError(Exception):
    """The adapter cannot be exported (one line: what and why)."""


@dataclass
class Report:
    out: Path
    base: Path
    name: str
    rank: int
    alpha: float
    megatron_modules: int
    hf_modules: int
    tensors: int
    target_modules: list[str]
    bytes_read: int
    checkpoint_bytes: int
    skipped: dict[str, list[str]] = field(default_factory=dict)

    @property
    def vllm_max_lora_rank(self) -> int:
        return next((r for r in VLLM_LORA_RANKS if r >= self.rank), self.rank)

    def serve_command(self) -> str:
        return (f"vllm serve {self.base} --enable-lora --lora-modules {self.name}={self.out} "
                f"--max-lora-rank {self.vllm_max_lora_rank}")


def export(checkpoint: str | Path, out: str | Path, base_model: str | Path | None = None,
           name: str | None = None) -> Report:
    """Export the LoRA adapter of run checkpoint `checkpoint` to `out`; raises ExportError & co."""
    ckpt = Path(checkpoint).expanduser()
    if not ckpt.is_dir():
        raise ExportError(f"{ckpt}: no such checkpoint directory (expected RUN/checkpoints/step_N)")
    try:
        checkpoints.verify(ckpt)
    except checkpoints.CheckpointError as e:
        raise ExportError(str(e)) from None
    cfg = typed(config_mod.load(ckpt / "config.yaml"))
    step = int(json.loads((ckpt / checkpoints.INFO).read_text())["step"])
    base = Path(base_model).expanduser() if base_model else paths.model_dir(cfg)
    where = "--base-model" if base_model else f"model.path/model.builtin of {ckpt / 'config.yaml'}"
    if not (base / "config.json").is_file():
        raise ExportError(f"{base}: no config.json, not an HF model directory (from {where}); "
                          "pass --base-model PATH")
    base = base.resolve()

    from workers.lora import checkpoint as lora_checkpoint, layout as lora_layout  # torch from here on

    try:
        layout = lora_layout.ModelLayout.from_hf_config(base)
    except ValueError as e:
        raise ExportError(f"{base / 'config.json'}: {e}") from None
    if layout.family != cfg.model.family:
        raise ExportError(f"{base / 'config.json'} is a {layout.family} model but {ckpt / 'config.yaml'} "
                          f"says model.family={cfg.model.family} (wrong --base-model?)")

    found = lora_checkpoint.scan(ckpt / "trainer")
    if not found.lora:
        raise ExportError(f"{found.directory}: no LoRA adapter tensors (*.adapter.linear_in/linear_out) in the "
                          f"checkpoint (the run had peft.enabled={str(cfg.peft.enabled).lower()}); nothing to export")
    state, bytes_read = lora_checkpoint.load_lora(found)
    try:
        factors = lora_layout.megatron_lora_modules(state)
    except (ValueError, NotImplementedError) as e:
        raise ExportError(str(e)) from None
    for module, (a, _) in factors.items():
        if a.shape[0] != cfg.peft.dim:
            raise ExportError(f"rank mismatch: {module} has LoRA rank {a.shape[0]} but {ckpt / 'config.yaml'} "
                              f"says peft.dim={cfg.peft.dim}")
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
    shapes = _base_weight_shapes(base)
    groups = [_spelled_as_base(g, layout.family, base, shapes) for g in hf_groups]

    out = Path(out).expanduser()
    lora_layout.write_peft_adapter(out, groups, cfg.peft.dim, cfg.peft.alpha, base_model_name_or_path=str(base))
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    hf_modules = sum(len(g.hf_modules) for g in groups)
    return Report(out=out.resolve(), base=base, name=name or f"{cfg.run.name}-step{step}", rank=cfg.peft.dim,
                  alpha=cfg.peft.alpha, megatron_modules=len(groups), hf_modules=hf_modules,
                  tensors=2 * hf_modules, target_modules=adapter_config["target_modules"],
                  bytes_read=bytes_read, checkpoint_bytes=found.total_bytes, skipped=found.skipped)


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
    from workers.lora.layout import FAMILIES, HfLoraGroup

    names = []
    for module, b in zip(group.hf_modules, group.lora_b):
        spellings = [module]
        rename = FAMILIES[family][2]  # (Megatron-Bridge registry prefix, transformers/vLLM prefix)
        if rename and module.startswith(rename[1]):
            spellings.append(rename[0] + module[len(rename[1]):])
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


def _base_weight_shapes(base: Path) -> dict[str, list[int]]:
    """{weight name: shape} from the safetensors headers of the base checkpoint (no tensor is read)."""
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{base}: no *.safetensors files to check module names against")
    shapes: dict[str, list[int]] = {}
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def _print_report(r: Report) -> None:
    print(f"wrote {r.tensors} tensors ({r.hf_modules} HF modules from {r.megatron_modules} Megatron LoRA modules; "
          f"rank {r.rank}, alpha {r.alpha:g}, target_modules {r.target_modules}) to {r.out}")
    print(f"read {r.bytes_read:,} of the checkpoint's {r.checkpoint_bytes:,} bytes (the LoRA tensors only)")
    total = sum(len(v) for v in r.skipped.values())
    print(f"skipped {total} entries:")
    for reason, keys in r.skipped.items():
        more = f", ... (+{len(keys) - 2} more)" if len(keys) > 2 else ""
        print(f"  {len(keys):4d} {reason}: {', '.join(keys[:2])}{more}")
    print(f"serve it with:\n  {r.serve_command()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.export",
                                description="Export a run checkpoint's LoRA adapter as an HF PEFT adapter.")
    p.add_argument("--checkpoint", required=True, help="RUN/checkpoints/step_N")
    p.add_argument("--out", required=True, help="directory for adapter_model.safetensors + adapter_config.json")
    p.add_argument("--base-model", help="HF base model directory (default: the checkpoint's config.yaml model)")
    p.add_argument("--name", help="adapter name for serving (default: <run.name>-step<N>)")
    args = p.parse_args(argv)
    from workers.lora.checkpoint import LoraCheckpointError  # torch-free module top

    try:
        report = export(args.checkpoint, args.out, args.base_model, args.name)
    except (ExportError, ConfigError, LoraCheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
