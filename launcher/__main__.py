"""`python -m launcher [key=value ...]`: validate, plan, then submit (or run here, or only print).

Any mistake in the config ends here with one line per problem naming the key (exit code 2),
before anything is written or submitted.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from launcher import paths
from launcher import plan as plan_mod
from launcher.config import compose as config_mod
from launcher.config.compose import ConfigError
from launcher.config.schema import typed
from launcher.config.validate import validate
from launcher.job import run_dir as run_dir_mod
from launcher.job import sbatch

HELP = """\
usage: python -m launcher [group=option ...] [key=value ...] [+resume=step_N|latest|PATH]

GRPO post-training with Megatron LoRA trainers and vLLM generators, on this machine or on Slurm.

examples:
  python -m launcher                                     # the embedded default: this machine, CPU, tiny model
  python -m launcher topology=ultra_6n4g dry_run=true    # the reference recipe: plan, config, sbatch
  python -m launcher topology=slurm_3n slurm.partition=gpu
  python -m launcher topology=slurm_3n +resume=latest    # continue the run in runs/<run.name>

config groups (conf/<group>/<option>.yaml):
{groups}

common keys:
  dry_run=true            print the placement plan, the resolved config and the sbatch script; touch nothing
  run.name=NAME           run directory <run.root>/NAME (default <topology>-<model>)
  grpo.max_num_steps=N    refit.mode=merged|merged_delta|adapter    peft.dim=R peft.alpha=A
  slurm.partition=P slurm.account=A slurm.time_min=M slurm.setup='[module load x]'

A run directory holds config.yaml (resolved), plan.txt, ray_job.sbatch, logs/, checkpoints/, metrics.
"""


def _help() -> str:
    groups = "\n".join(f"  {g:<14} {', '.join(config_mod.group_options(g))}" for g in config_mod.GROUPS)
    return HELP.format(groups=groups)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(_help())
        return 0
    bad = [a for a in argv if a.startswith("-")]
    if bad:
        print(f"error: {bad[0]}: not an option; arguments are key=value overrides (see --help)", file=sys.stderr)
        return 2
    try:
        raw = config_mod.compose(argv)
        cfg = typed(raw)
        errors = validate(cfg, submitting=not cfg.dry_run)
        if errors:
            for e in errors:
                print(f"error: {e}", file=sys.stderr)
            return 2
        paths.absolute_config(cfg)  # every path absolute, once, before anything reads it
        plan = plan_mod.build(cfg.topology)
        run_dir = paths.run_dir(cfg)
        spec = sbatch.job_spec(cfg, plan) if cfg.topology.executor == "slurm" else None
        if cfg.dry_run:
            _print_dry_run(cfg, raw, plan, run_dir, spec)
            return 0
        run_dir_mod.prepare(cfg, raw, plan, run_dir, spec)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if spec is None:
        return _run_here(cfg, plan, run_dir)
    if not cfg.submit:
        print(f"wrote {run_dir} (config.yaml, plan.txt, ray_job.sbatch); submit it with:\n"
              f"  sbatch {run_dir}/ray_job.sbatch")
        return 0
    return _submit(cfg, plan, run_dir)


def _print_dry_run(cfg, raw, plan, run_dir: Path, spec) -> None:
    from launcher.job.submit import submitit_folder

    print(f"== plan: topology {cfg.topology.name} ({cfg.topology.executor}, {len(plan.nodes)} node(s))")
    print(plan.describe())
    print(f"\n== resolved config (would be written to {run_dir}/config.yaml)")
    print(config_mod.to_yaml(run_dir_mod.resolved(raw, run_dir)).rstrip())
    if cfg.model.path and not Path(cfg.model.path).exists():
        print(f"\nnote: model.path {cfg.model.path} does not exist on this machine; submission requires it")
    if spec is None:
        print("\n== executor local: runs in this process on this machine (no sbatch script)")
    else:
        print(f"\n== sbatch script submitit would submit (folder {submitit_folder(run_dir)})")
        print(sbatch.submitit_script(spec, submitit_folder(run_dir)))
        print(f"== also written on submission: {run_dir}/ray_job.sbatch (the same job for plain `sbatch`)")


def _submit(cfg, plan, run_dir: Path) -> int:
    from launcher.job.submit import submit_slurm

    try:
        job = submit_slurm(cfg, plan, run_dir)
    except Exception as e:  # sbatch refused (bad partition, no Slurm...): say what Slurm said
        print(f"error: submission failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e}",
              file=sys.stderr)
        return 1
    run_dir_mod.record_submission(run_dir, job.job_id)
    log = run_dir / "submitit" / job.job_id / f"{job.job_id}_0_log.out"
    print(f"submitted job {job.job_id} ({len(plan.nodes)} nodes) for run {cfg.run.name}")
    print(f"  run directory: {run_dir}")
    print(f"  follow the driver: tail -F {log}")
    print(f"  Ray logs per node: {run_dir}/logs/   status: squeue -j {job.job_id}   cancel: scancel {job.job_id}")
    return 0


def _run_here(cfg, plan, run_dir: Path) -> int:
    from launcher.cluster.bootstrap import record_failure, resume_after_requeue
    from launcher.cluster.context import ClusterError, log
    from launcher.job.submit import run_local

    log(f"run directory {run_dir}")
    t0 = time.time()
    restarts = 0
    while True:
        try:
            result = run_local(cfg, plan, run_dir, attempt=restarts).get("result") or {}
            break
        except ClusterError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            restarts = record_failure(run_dir, f"local-{os.getpid()}", e)
            if restarts > cfg.retry.max_restarts:
                return 1
            cfg.resume = resume_after_requeue(cfg, run_dir)
            log(f"restart {restarts}/{cfg.retry.max_restarts} (retry.max_restarts) from "
                f"{cfg.resume or 'the beginning (no complete checkpoint yet)'}")
        except KeyboardInterrupt:
            print("interrupted: stopped at once (no checkpoint); Ray and vLLM processes are stopped", file=sys.stderr)
            return 130
    if result.get("stopped"):
        print(f"stopped at step {result['step']} after saving a checkpoint; continue with the same command "
              f"and +resume=latest", file=sys.stderr)
        return 130
    log(f"finished in {time.time() - t0:.0f}s; everything is in {run_dir}")
    return 0


def cli() -> int:
    try:
        return main()
    except BrokenPipeError:  # `python -m launcher ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(cli())
