"""Everything the job checks when it starts, as one function the launcher runs at submission too.

A run the launcher accepts must be one the job accepts: a refusal found minutes later on the
cluster (after the wait in the queue, with the nodes allocated) is the costliest kind. So what the
job would refuse at start is checked here, torch-free, by the launcher at submission (on the login
node: launcher.job.run_dir.check) and by the job again before Ray and the actors start
(launcher.cluster.bootstrap), on the same inputs; the driver resumes through `resume` too:

  the job's components   vLLM's context length against the model's positions, the rope megatron-core
                         and vLLM both build, megatron's scheduler arguments
                         (launcher.config.job_limits.errors)
  a resume               the checkpoint `+resume` names: complete, its records agreeing with each other
                         and its rollouts generated ahead with its records (checkpoints.verify); written
                         for this model, LoRA shape and optimizer (checkpoints.check_compatible); the
                         same learning-rate schedule, which megatron's scheduler refuses to change
                         (job_limits.schedule_changes); steps left to run. A finished run's hint names
                         what continues it (more steps with the schedule it was trained with).

Each refusal is one ConfigError naming the key. tests/unit/test_start_check.py runs every case both
ways (the launcher, and the job's own start) on the same inputs and requires the same line.
"""

from __future__ import annotations

from pathlib import Path

from launcher import paths, records
from launcher.config import job_limits
from launcher.config.schema import Config, ConfigError


def check(cfg: Config, run_dir: Path, resuming: bool = True):
    """Raise the first ConfigError the job would meet when it starts; with `resuming` and a
    `+resume`, return (the CheckpointManager, the checkpoint) it resumes from (else None)."""
    errs = job_limits.errors(cfg)
    if errs:
        raise errs[0]
    return resume(cfg, run_dir) if resuming and cfg.resume is not None else None


def resume(cfg: Config, run_dir: Path, finished_ok: bool = False):
    """(manager, checkpoint) of `+resume`, every resume check passed; a one-line ConfigError otherwise.
    `finished_ok`: a checkpoint at the last step is no error (the driver restarting its own run
    after a failure past its last checkpoint runs no step and finishes)."""
    from launcher.driver.checkpoints import CheckpointManager, check_compatible, nothing_left

    manager = CheckpointManager(paths.checkpoint_dirs(cfg, run_dir), cfg.checkpointing)
    ckpt = manager.resolve(cfg.resume)  # its files and records (checkpoints.verify)
    check_compatible(ckpt.path, cfg)
    saved = records.load_config(ckpt.path / paths.CONFIG, typed=True)  # verified: it reads
    if nothing_left(cfg, ckpt.step) and not finished_ok:
        raise ConfigError("grpo.max_num_steps", f"{ckpt.path} is at step {ckpt.step}: the run has done its "
                                                f"{cfg.grpo.max_num_steps} steps; to train on, resume with "
                                                f"{continue_hint(saved, cfg, ckpt.step)}")
    changed = job_limits.schedule_changes(saved, cfg)
    if changed:
        key, before, now = changed[0]
        fix = f"optim.lr_decay_iters={before}" if key == "grpo.max_num_steps" else f"{key}={before}"
        raise ConfigError(key, f"{ckpt.path} was trained with a learning-rate schedule of {key} = {before}, this run "
                               f"has {now}: megatron's scheduler refuses to continue another schedule; resume with "
                               f"{fix}, or with optim.override_opt_param_scheduler=true (this run's schedule from "
                               f"step {ckpt.step})")
    return manager, ckpt


def continue_hint(saved: Config, cfg: Config, step: int) -> str:
    """The overrides that continue a finished run past `step` with the schedule it was trained with
    (with optim.lr_decay_iters null its decay steps are grpo.max_num_steps: they are pinned)."""
    hint = f"grpo.max_num_steps=N above {step}"
    steps = job_limits.decay_steps(saved.optim, saved.grpo.max_num_steps)
    if not cfg.optim.override_opt_param_scheduler and cfg.optim.lr_decay_iters != steps:
        hint += (f" and optim.lr_decay_iters={steps} (the learning-rate schedule it was trained with; or "
                 f"optim.override_opt_param_scheduler=true for this run's)")
    return hint
