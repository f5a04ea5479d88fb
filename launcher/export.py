"""`python -m launcher.export --checkpoint RUN/checkpoints/step_N --out DIR [--base-model PATH] [--name NAME]`

Post-training adapter serving: writes a run checkpoint's LoRA adapter as an HF PEFT adapter
(`adapter_model.safetensors` + `adapter_config.json`) that `PeftModel.from_pretrained` and
`vllm serve BASE --enable-lora --lora-modules NAME=DIR` load. During training the generators get
merged weights instead (refit); this is for serving the result.

This module is the command: the run's side (checkpoint, config, base model directory), the
messages and the exit codes. The adapter itself is written by `workers.lora.export`.
  checkpoint   `launcher.driver.checkpoints.verify` (complete step_N), `config.yaml` read with the launcher's
               own schema (peft.dim / alpha, model.*); `trainer/` is read by `workers.lora.checkpoint`
               (LoRA entries only, from the DCP metadata; no model, no process group, no base weights)
  base model   `--base-model`, else `launcher.paths.model_dir(config)`; the run's model facts (config.yaml,
               launcher.config.model_facts) give the layout (heads, KV groups, head_dim; heads * head_dim
               may differ from hidden), and the base's config.json must have the same shape
  adapter      `workers.lora.export.export_adapter`: HF module names from Megatron-Bridge's registry,
               each checked against the base checkpoint's weight names and shapes
Mistakes (missing/incomplete checkpoint, no adapters, rank mismatch, unknown module, wrong base) are
one line on stderr, exit code 2. This module imports no torch at import time (the launcher's rule).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from launcher import files, paths, shell
from launcher.driver import checkpoints
from launcher.config import compose as config_mod
from launcher.config import model_facts
from launcher.config.schema import VLLM_LORA_RANKS, ConfigError
from workers.lora.checkpoint import LoraCheckpointError  # torch-free module top
from workers.lora.export import AdapterExport, ExportError, export_adapter  # torch-free module top


@dataclass(kw_only=True)
class Report(AdapterExport):
    """What was written (AdapterExport) and how to serve it."""

    base: Path
    name: str
    rank: int
    alpha: float

    @property
    def vllm_max_lora_rank(self) -> int:
        return next((r for r in VLLM_LORA_RANKS if r >= self.rank), self.rank)

    def serve_command(self) -> str:
        """The `vllm serve` line to paste: every word quoted (launcher.shell), the adapter's name one
        that passes the run-name rule (check_name)."""
        from workers import hf_checkpoint  # imports torch (the export already did); the module top stays torch-free

        check_name(self.name)
        words = ["vllm", "serve", self.base, "--enable-lora", "--lora-modules", f"{self.name}={self.out}",
                 "--max-lora-rank", self.vllm_max_lora_rank]
        outside = hf_checkpoint.lora_targets_outside_experts(self.base)
        if outside is not None:  # an MoE base: the experts, which no adapter of ours touches, stay unwrapped
            words += ["--lora-target-modules", *outside]
        return shell.command(*words)


ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
_NAME = paths.RUN_NAME   # the adapter's name: the run-name rule


def check_out(out: Path, checkpoint: Path | None = None) -> None:
    """`--out` before anything is read: a folder that does not exist yet, or one holding only an
    earlier export (it is replaced whole); never a file, never a folder with other files, never
    inside the checkpoint it reads or any run's checkpoints (its files would be a checkpoint's
    files that no manifest lists: no longer resumable nor exportable)."""
    inside = _inside_checkpoints(out, checkpoint)
    if inside is not None:
        raise ExportError(f"--out {out}: inside {inside}, a run's checkpoints (they hold only what the run writes: "
                          f"an export there makes them unusable); give a directory outside it")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: exists and is not a directory; give a new directory for the adapter")
    if out.is_dir():
        other = sorted(p.name for p in out.iterdir() if p.name not in ADAPTER_FILES)
        if other:
            raise ExportError(f"--out {out}: holds other files ({', '.join(other[:3])}); give a new directory "
                              f"(an earlier export there is replaced)")
    parent = next(p for p in [out.parent, *out.parent.parents] if p.exists())
    if not parent.is_dir():
        raise ExportError(f"--out {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"--out {out}: {parent} is not writable")


def _inside_checkpoints(out: Path, checkpoint: Path | None) -> Path | None:
    """The checkpoint (or a run's checkpoint folder) `out` lies in, or None. Links resolved: a path
    through a symlink into a checkpoint is inside it."""
    try:
        real = paths.absolute(out)
        ckpt = paths.absolute(checkpoint) if checkpoint is not None else None
    except (OSError, RuntimeError):
        return None  # check_out names what is wrong with the path itself
    folder = ckpt.parent if ckpt is not None and paths.STEP.match(ckpt.name) and ckpt.is_dir() else None
    for p in [real, *real.parents]:
        if ckpt is not None and p in (ckpt, folder):   # the checkpoint, its run's checkpoint folder
            return p
        if paths.STEP.match(p.name) and (p / paths.MANIFEST).is_file():
            return p
        if p.name == paths.CHECKPOINTS and (p.parent / paths.CONFIG).is_file():
            return p
    return None


def check_name(name: str | None) -> None:
    """The adapter's serving name: one word (`--lora-modules NAME=DIR` parses it)."""
    if name is not None and not _NAME.match(name):
        raise ExportError(f"--name {name!r}: must be one word of letters, digits and . _ + - (vLLM's "
                          f"--lora-modules NAME=DIR reads it)")


def export(checkpoint: str | Path, out: str | Path, base_model: str | Path | None = None,
           name: str | None = None) -> Report:
    """Export the LoRA adapter of run checkpoint `checkpoint` to `out`; raises ExportError & co.
    Every input is checked before anything is written: `out`, the name, the checkpoint (its files
    and records: checkpoints.verify), its config.yaml, the base model; the adapter is written into
    a private folder beside `out` and renamed into place whole, with the modes of the checkpoint's
    run (launcher.files: run.shared_with_group)."""
    out = Path(out).expanduser()
    ckpt = Path(checkpoint).expanduser()
    check_out(out, ckpt)
    check_name(name)
    if not ckpt.is_dir():
        raise ExportError(f"{ckpt}: no such checkpoint directory (expected RUN/checkpoints/step_N)")
    try:
        checkpoints.verify(ckpt)
    except checkpoints.CheckpointError as e:
        raise ExportError(str(e)) from None
    cfg = config_mod.load_typed(ckpt / paths.CONFIG)
    step = checkpoints.Checkpoint(0, ckpt).info()["step"]
    base = Path(base_model).expanduser() if base_model else paths.model_dir(cfg)
    where = "--base-model" if base_model else f"model.path/model.builtin of {ckpt / paths.CONFIG}"
    if not (base / "config.json").is_file():
        raise ExportError(f"{base}: no config.json, not an HF model directory (from {where}); "
                          "pass --base-model PATH")
    base = base.resolve()
    try:  # a config.json that is not an object, lacks the head counts or has a string for a number
        base_facts, _ = model_facts.read(base)
    except ConfigError as e:
        raise ExportError(f"{e.message} (the base model, from {where})") from None
    config_file = ckpt / paths.CONFIG
    run_facts = model_facts.of_section(asdict(cfg.model))  # None: a checkpoint from before facts were saved
    family = run_facts.family if run_facts else cfg.model.family
    if family and base_facts.family != family:
        raise ExportError(f"{base / 'config.json'} is a {base_facts.family} model but {config_file} "
                          f"says model.family={family} (wrong --base-model?)")
    differ = model_facts.shape_differences(run_facts, base_facts) if run_facts else []
    if differ:
        raise ExportError(f"{base / 'config.json'} is not shaped like the model {config_file} trained: "
                          f"{'; '.join(differ)} (wrong --base-model?)")

    policy = files.Policy.of(cfg)
    if not out.parent.exists():
        files.make_dir(out.parent, policy)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        done = export_adapter(ckpt / paths.TRAINER, staging, base, facts=run_facts or base_facts, dim=cfg.peft.dim,
                              alpha=cfg.peft.alpha, peft_enabled=cfg.peft.enabled, config_file=config_file)
        files.publish(staging, out, policy)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Report(**{**vars(done), "out": out.resolve()}, base=base,
                  name=name or paths.safe_name(f"{cfg.run.name}-step{step}"), rank=cfg.peft.dim, alpha=cfg.peft.alpha)


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


def parser():
    from launcher.cli import Parser

    p = Parser(prog="python -m launcher.export",
               description="Export a run checkpoint's LoRA adapter as an HF PEFT adapter.")
    p.add_argument("--checkpoint", required=True, help="RUN/checkpoints/step_N")
    p.add_argument("--out", required=True, help="a new directory for adapter_model.safetensors + adapter_config.json")
    p.add_argument("--base-model", help="HF base model directory (default: the checkpoint's config.yaml model)")
    p.add_argument("--name", help="adapter name for serving (default: <run.name>-step<N>)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command, under launcher.cli.run: every mistake (arguments, --out, the checkpoint and its
    records, the base model) is one line, exit code 2, before anything is written."""
    from launcher import cli

    return cli.run(_main, argv, user_errors=(ExportError, LoraCheckpointError))


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    _print_report(export(args.checkpoint, args.out, args.base_model, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
