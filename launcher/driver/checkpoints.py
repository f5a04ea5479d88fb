"""Checkpoints `step_N/`: written whole into `tmp_step_N/`, renamed when complete, pruned by metric.

A checkpoint directory holds:
  training_info.json  step, consumed prompts (the dataloader position), the step's metrics
  config.yaml         the resolved config of the run that wrote it
  trainer/            adapter + optimizer + scheduler + RNG states of every trainer rank
                      (torch distributed checkpoint, written by the trainers themselves)
  manifest.json       every file above with its size and sha256; written last. Its presence and a
                      match of every file is what "complete" means, and it is checked before
                      anything is loaded: torch's checkpoint metadata is a pickle, so a file
                      truncated, replaced or written by someone else is refused before it is read.
                      A matching manifest is not trust (anyone who can write the folder can write
                      it): entries must stay inside the checkpoint, and every `.metadata` is
                      unpickled with workers.safe_unpickle (checkpoint classes only) first
Only `step_N` directories with a matching manifest count; `tmp_step_N` (a save interrupted by a
crash or a full disk) is ignored and cleared by the next save of that step.
Retention: the checkpoint just written and the latest are always kept, plus the `keep_top_k` best
by `metric_name`. Resuming from an older step starts a branch (`start_branch`): the newer
checkpoints and metrics rows are moved aside under `abandoned/`, never deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from launcher import files, paths, records
from launcher.config import bounded, model_facts
from launcher.config.schema import Checkpointing, ConfigError
from launcher.paths import absolute

MANIFEST = paths.MANIFEST
INFO = paths.TRAINING_INFO
CONFIG = paths.CONFIG
TRAINER = paths.TRAINER


class CheckpointError(Exception):
    """A checkpoint cannot be used (names the file and what is wrong)."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path

    def info(self) -> dict:
        return _record(self.path / INFO, records.TRAINING_INFO)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with bounded.open_regular(path) as f:  # a FIFO put in a file's place must not block
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except bounded.FileError as e:
        raise CheckpointError(str(e)) from None
    return h.hexdigest()


def _files(root: Path) -> dict[str, dict]:
    return {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _check_rollouts_ahead(path: Path, info: dict, config) -> None:
    """A pipelined checkpoint's rollouts.json: its schema, and its agreement with the checkpoint's other
    records: the steps training_info.json says were generated ahead (N+1.., at most max_lag of them,
    each with weights from the max_lag steps before it, from data at or after N's position, in
    order), the max_lag of both, and the sampling settings of its config.yaml (`config`): the same
    settings, and each step's samples the size those settings make (num_prompts_per_step x
    num_generations_per_prompt; responses of at most max_new_tokens, prompt + response at most
    max_total_sequence_length). A resume that trains on them can rely on it."""
    from launcher.driver.pipeline import sampling_settings

    saved = info.get("pipeline") or {}
    ahead = saved.get("ahead") or []
    if not ahead:
        return
    body = _record(path / paths.ROLLOUTS, records.ROLLOUTS)
    step, where = info["step"], path / paths.ROLLOUTS
    steps, lag = [r["step"] for r in body["rollouts"]], body["max_lag"]

    def disagree(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {what}; the checkpoint's records disagree, not resumable")

    if steps != ahead or ahead != list(range(step + 1, step + 1 + len(ahead))):
        raise disagree(f"holds steps {steps}, {INFO} says {ahead} after step {step}")
    for r in body["rollouts"]:
        if r["version"] >= r["step"] or r["position"] < info["consumed_prompts"]:
            raise CheckpointError(f"{where}: step {r['step']} generated with weights {r['version']} from data "
                                  f"position {r['position']} (the checkpoint is at step {step}, position "
                                  f"{info['consumed_prompts']}); not resumable")
    if lag != saved.get("max_lag"):
        raise disagree(f"max_lag: {lag}, {INFO} says pipeline.max_lag {saved.get('max_lag')}")
    if len(ahead) > lag:
        raise disagree(f"holds {len(ahead)} steps generated ahead, more than its max_lag {lag} allows")
    positions = [r["position"] for r in body["rollouts"]]
    for r in body["rollouts"]:
        if r["version"] < r["step"] - 1 - lag:
            raise disagree(f"step {r['step']} generated with the weights of step {r['version']}, more than max_lag "
                           f"{lag} steps before it")
    if positions != sorted(positions):
        raise disagree(f"data positions {positions} go backwards")
    now = json.loads(json.dumps(sampling_settings(config)))
    if body["sampling"] != now:
        changed = next((f"{k}.{x}" for k, section in now.items() for x in section
                        if (body["sampling"].get(k) or {}).get(x) != section[x]), "its keys")
        raise disagree(f"sampling: {changed} is not what the checkpoint's {CONFIG} says")
    g = config.grpo
    rows = g.num_prompts_per_step * g.num_generations_per_prompt
    for r in body["rollouts"]:
        s = r["rollout"]
        if len(s["rewards"]) != rows:
            raise disagree(f"step {r['step']} holds {len(s['rewards'])} samples, its sampling settings make {rows} "
                           f"(grpo.num_prompts_per_step {g.num_prompts_per_step} x num_generations_per_prompt "
                           f"{g.num_generations_per_prompt})")
        episodes = bool(s.get("response_mask"))  # multi-turn: the environment's tokens count too
        for p_ids, r_ids in zip(s["prompt_ids"], s["response_ids"]):
            if (len(r_ids) > g.max_new_tokens and not episodes) or len(p_ids) + len(r_ids) > g.max_total_sequence_length:
                raise disagree(f"step {r['step']} holds a sample of {len(p_ids)} + {len(r_ids)} tokens, longer than "
                               f"grpo.max_new_tokens {g.max_new_tokens} / max_total_sequence_length "
                               f"{g.max_total_sequence_length} allow")


def verify(path: Path) -> None:
    """Raise CheckpointError naming the first missing, truncated or unreadable file, or the first
    record that is not what this launcher writes (launcher.records) or disagrees with another: a
    checkpoint's step is its folder's N (step_N), its training_info.json's and its trainer state's."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {MANIFEST})")
    expected = _record(manifest, records.MANIFEST)["files"]
    listed = {rel: (e["size"], e["sha256"]) for rel, e in expected.items()}
    root = path.resolve()
    for rel in listed:
        parts = Path(rel).parts
        if "\0" in rel:  # no file has such a name (and Path.resolve raises on it)
            raise CheckpointError(f"{manifest}: entry {rel!r} holds a NUL byte, not a file name; not a checkpoint "
                                  f"of this launcher")
        if not rel or Path(rel).is_absolute() or ".." in parts or not (path / rel).resolve().is_relative_to(root):
            raise CheckpointError(f"{manifest}: entry {rel!r} points outside the checkpoint; not a checkpoint "
                                  f"of this launcher")
    for rel, (size, digest) in listed.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (listed in {MANIFEST})")
        if f.stat().st_size != size:
            raise CheckpointError(f"{f}: {f.stat().st_size} bytes, the manifest says {size} (truncated?)")
        if _sha256(f) != digest:
            raise CheckpointError(f"{f}: content differs from the manifest (modified or replaced after the save)")
    extra = sorted(str(p.relative_to(path)) for p in path.rglob("*")  # a FIFO, socket or link as much as a file
                   if (p.is_symlink() or not p.is_dir()) and p.name != MANIFEST and str(p.relative_to(path)) not in listed)
    if extra:
        raise CheckpointError(f"{path / extra[0]}: not part of the checkpoint (not in {MANIFEST})")
    info = _record(path / INFO, records.TRAINING_INFO)
    m = paths.STEP.match(path.name)
    if m and int(m.group(1)) != info["step"]:
        raise CheckpointError(f"{path / INFO}: step: {info['step']}, but the folder is {path.name}; the checkpoint's "
                              f"records disagree, not resumable")
    for rel in listed:
        if Path(rel).name.endswith(".metadata"):
            _check_storage(path / rel, _check_pickle(path / rel))
    _check_trainer_step(path, info["step"])
    try:
        config = records.load_config(path / CONFIG, typed=True)
    except records.RecordError as e:
        raise CheckpointError(str(e)) from None
    _check_rollouts_ahead(path, info, config)


def _record(path: Path, record: records.Record) -> dict:
    try:
        return records.load(path, record)
    except records.RecordError as e:
        raise CheckpointError(str(e)) from None


def _check_trainer_step(path: Path, step: int) -> None:
    """The trainers' own step (saved in their state by workers.trainer.state.save_state) is the
    checkpoint's: a resume continues the optimizer and the scheduler from it."""
    from workers import safe_unpickle
    from workers.trainer.state import SavedStateError, saved_trainer_info

    try:
        saved = saved_trainer_info(str(path / TRAINER))["step"]
    except SavedStateError as e:
        raise CheckpointError(str(e)) from None
    except safe_unpickle.Refused as e:
        raise CheckpointError(f"{path / TRAINER}: {e}; the checkpoint was not written by this launcher, nothing "
                              f"was run") from None
    if saved != step:
        raise CheckpointError(f"{path / INFO}: step: {step}, but the trainer state in {path / TRAINER} is at step "
                              f"{saved}; the checkpoint's records disagree, not resumable")


def _check_pickle(f: Path):
    """A torch distributed checkpoint `.metadata` is a pickle: unpickle it with workers.safe_unpickle
    (only the classes checkpoint metadata needs), before any reader unpickles it for real."""
    from workers import safe_unpickle

    try:
        with bounded.open_regular(f) as fh:
            return safe_unpickle.load(fh)
    except bounded.FileError as e:
        raise CheckpointError(str(e)) from None
    except safe_unpickle.Refused as e:
        raise CheckpointError(f"{f}: {e}; the checkpoint was not written by this launcher, nothing was run") from None
    except Exception as e:  # noqa: BLE001 - truncated or foreign bytes: the same user-facing problem
        raise CheckpointError(f"{f}: not torch checkpoint metadata ({type(e).__name__})") from None


def _check_storage(f: Path, metadata) -> None:
    """Every byte range the DCP metadata `f` names lies in a data file of its own folder: a `.distcp`
    cut short (with a manifest rewritten to match) is named here, not met by a reader mid-load."""
    sizes: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel, offset, length = getattr(info, "relative_path", None), getattr(info, "offset", None), \
            getattr(info, "length", None)
        if not isinstance(rel, str) or not rel or "/" in rel or rel in (".", "..") \
                or not all(isinstance(x, int) and x >= 0 for x in (offset, length)):
            raise CheckpointError(f"{f}: names data {rel!r} at {offset}+{length}, not a file of {f.parent} and a "
                                  f"byte range; not a checkpoint of this launcher")
        if rel not in sizes:
            data = f.parent / rel
            if not data.is_file():
                raise CheckpointError(f"{data}: missing ({f.name} names it)")
            sizes[rel] = data.stat().st_size
        if offset + length > sizes[rel]:
            raise CheckpointError(f"{f.parent / rel}: {sizes[rel]} bytes, but {f.name} says its data runs to byte "
                                  f"{offset + length} (cut short?); the checkpoint is damaged")


# what a checkpoint's adapter/optimizer tensors depend on: resuming with any of these changed
# would load tensors of the wrong shape or meaning (the base model: which weights the adapters
# were trained on, not only its shape; the optimizer: what its state tensors are)
COMPATIBLE = (("model", ("family", "builtin", "path", *model_facts.FACT_KEYS[1:], "dtype")),
              ("peft", ("enabled", "dim", "target_modules", "alpha", "lora_dtype")),
              ("optim", ("optimizer",)))
_PATHS = {("model", "path")}


def nothing_left(cfg, step: int) -> bool:
    """A GRPO run continued from a checkpoint at `step` would run no step (cfg: schema.Config)."""
    return cfg.run.job == "grpo" and step >= cfg.grpo.max_num_steps


def check_compatible(ckpt: Path, cfg) -> None:
    """ConfigError if the checkpoint was written for another model or LoRA shape than `cfg`'s."""
    from launcher.config import compose as config_mod

    try:
        saved = config_mod.load(ckpt / CONFIG)  # its schema: launcher.records.load_config
    except ConfigError as e:
        raise ConfigError("resume", f"{e}; not a checkpoint of this launcher") from None
    for section, keys in COMPATIBLE:
        for key in keys:
            if key not in (saved.get(section) or {}):
                continue  # a checkpoint written before the key existed
            before, now = (saved.get(section) or {}).get(key), getattr(getattr(cfg, section), key)
            if isinstance(before, (DictConfig, ListConfig)):
                before = OmegaConf.to_container(before, resolve=True)
            if (section, key) in _PATHS:
                before, now = (str(absolute(v)) if v else None for v in (before, now))
            if before != now:
                raise ConfigError("resume", f"{ckpt} was written for {section}.{key}={before} "
                                            f"({saved.get('model', {}).get('name')}), this run has {now} "
                                            f"({cfg.model.name}): not resumable")


class CheckpointManager:
    def __init__(self, root: Path, cfg: Checkpointing):
        self.root = Path(root)
        self.cfg = cfg

    def complete(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first."""
        out = []
        for step, p in paths.step_dirs(self.root):
            try:
                verify(p)
            except CheckpointError:
                continue
            out.append(Checkpoint(step, p))
        return out

    def resolve(self, spec: str) -> Checkpoint:
        """`latest`, `step_N` or a path -> a complete checkpoint; else a one-line ConfigError."""
        done = self.complete()
        listing = ", ".join(c.path.name for c in done) or "none"
        path = paths.resume_path(spec, self.root)  # latest: the newest; a damaged one is an error, not skipped
        if path is None:
            raise ConfigError("resume", f"no complete checkpoint in {self.root} to resume from")
        if not path.is_dir():
            raise ConfigError("resume", f"{path} does not exist; complete checkpoints in {self.root}: {listing}")
        try:
            verify(path)
        except CheckpointError as e:
            raise ConfigError("resume", f"{e}; complete checkpoints in {self.root}: {listing}") from None
        return Checkpoint(_record(path / INFO, records.TRAINING_INFO)["step"], path)

    def start_branch(self, ckpt: Checkpoint, run_dir: Path) -> Path | None:
        """Resuming from `ckpt` when newer checkpoints or metrics rows exist starts a new branch:
        every `step_N` with N > ckpt.step moves to `<checkpoints>/abandoned/<time>-from-step_S/`
        and the metrics rows after S to `<run dir>/abandoned/<same>/metrics.jsonl` (renames, nothing
        is deleted). Retention and a requeue then only see the branch's own checkpoints. Returns
        the folder the checkpoints went to, or None when nothing was newer."""
        newer = [p for step, p in paths.step_dirs(self.root) if step > ckpt.step and p.resolve() != ckpt.path.resolve()]
        metrics = run_dir / paths.METRICS
        rows = metrics.read_text().splitlines(keepends=True) if metrics.is_file() else []
        later = [r for r in rows if _row_step(r) > ckpt.step]
        if not newer and not later:
            return None
        name = f"{time.strftime('%Y%m%d-%H%M%S')}-from-step_{ckpt.step}"
        aside = self.root / paths.ABANDONED / name
        if newer:  # (a run killed before its first checkpoint after S has only newer metrics rows)
            files.make_dir(aside)
        for p in newer:
            os.replace(p, aside / p.name)
        if later:
            files.write(run_dir / paths.ABANDONED / name / paths.METRICS, "".join(later))
            files.write(metrics, "".join(r for r in rows if _row_step(r) <= ckpt.step))
        return aside

    def due(self, step: int, last_step: int, stopping: bool = False) -> bool:
        """Save now? Every save_period steps, at the last step and when stopping; never when disabled."""
        return self.cfg.enabled and (stopping or step % self.cfg.save_period == 0 or step == last_step)

    def begin(self, step: int) -> Path:
        tmp = self.root / f"tmp_step_{step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        return files.make_dir(tmp)  # the policy of the checkpoint folder (launcher.files)

    def commit(self, tmp: Path, step: int, info: dict, config_yaml: str) -> Checkpoint:
        """Write the driver's files and the manifest into `tmp`, then rename it to step_N."""
        files.write_json(tmp / INFO, {"step": step, **info, "time": time.time()})
        files.write(tmp / CONFIG, config_yaml)
        files.write_json(tmp / MANIFEST, {"files": _files(tmp)})
        # the trainer ranks' files brought to the folder's policy; a rerun of this step after a crash replaces it
        final = files.publish(tmp, self.root / f"step_{step}")
        verify(final)  # what a resume checks: a writer and its reader that disagree fail here, loudly
        self._retain(final)
        return Checkpoint(step, final)

    def _metric(self, c: Checkpoint) -> float | None:
        try:
            v = c.info().get("metrics", {}).get(self.cfg.metric_name)
            return float(v) if v is not None else None
        except (CheckpointError, ValueError):
            return None

    def _retain(self, written: Path) -> None:
        """Keep the checkpoint just written, the newest, and the keep_top_k best by the metric."""
        done = self.complete()
        if not done or self.cfg.keep_top_k is None:
            return
        sign = 1.0 if self.cfg.higher_is_better else -1.0
        ranked = sorted(done, key=lambda c: (self._metric(c) is not None, sign * (self._metric(c) or 0.0), c.step),
                        reverse=True)
        keep = {written, done[-1].path} | {c.path for c in ranked[: self.cfg.keep_top_k]}
        for c in done:
            if c.path not in keep:
                shutil.rmtree(c.path, ignore_errors=True)


def _row_step(line: str) -> float:
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1.0   # an unreadable row stays where it is
