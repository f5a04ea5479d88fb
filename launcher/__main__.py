"""`python -m launcher [--cfg job|all] [-m] [key=value ...]`: validate, plan, then submit (or run
here, or only print). `-m` (--multirun) sweeps: one run per point (launcher/sweep.py).
`--help SECTION|KEY` lists keys with their type, default, allowed values and doc, read from the
schema (launcher.config.schema declares each on the field).

Any mistake in the config ends here with one line per problem naming the key (exit code 2),
before anything is written or submitted; in a sweep, before any point is.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from launcher import files, logs, paths, shell
from launcher import sweep as sweep_mod
from launcher import memory, refit_cost
from launcher import plan as plan_mod
from launcher.config import compose as config_mod
from launcher.config import fields
from launcher.config.schema import Config, ConfigError, typed
from launcher import cli as cli_mod
from launcher.cli import Parser
from launcher.config.validate import validate
from launcher.job import run_dir as run_dir_mod
from launcher.job import sbatch, slurm_job
from launcher.cluster import stop as stop_mod

if TYPE_CHECKING:
    from omegaconf import DictConfig

HELP = """\
usage: python -m launcher [--cfg job|all] [-m [--max-points N]] [-q | -v] [group=option ...] [key=value ...]
                          [+resume=step_N|latest|PATH]
       python -m launcher --help SECTION|KEY ...     the keys: type, default, allowed values, what each does

GRPO post-training with Megatron LoRA trainers and vLLM generators, on this machine or on Slurm.

examples:
  python -m launcher                                     # the embedded default: this machine, CPU, tiny model
  python -m launcher topology=ultra_6n4g dry_run=true    # the reference recipe: plan, config, sbatch
  python -m launcher topology=slurm_3n slurm.partition=gpu
  python -m launcher topology=slurm_3n +resume=latest    # continue the run in runs/<run.name>
  python -m launcher -m topology=slurm_2n peft.dim=8,16 optim.lr=1e-4,3e-4   # a sweep: one job per point
  python -m launcher env=guess_number                    # multi-turn episodes: the demo environment

options:
  --cfg job               print the resolved run config (what config.yaml will hold) and exit
  --cfg all               the same, then what the launcher derives from it (run directory, plan)
  -m, --multirun          sweep: a=1,2  a=choice(x,y)  a=range(1,5)  topology=glob(slurm_*); every point is
                          validated before any is submitted; runs are named <run.name>-<swept values>
  --max-points N          the most points a sweep may have (default {max_points})
  -q, --quiet             only warnings and errors (no progress lines); -v, --verbose: also debug lines
  follow runs:            python -m launcher.status [RUN_DIR | SWEEP_DIR | run.name=NAME] [--watch] [--json]
  stop a run:             python -m launcher.stop RUN_DIR|SWEEP_DIR   (after its next checkpoint; no requeue)

config groups (conf/<group>/<option>.yaml):
{groups}

common keys (every key of a section: python -m launcher --help SECTION, e.g. --help grpo.loss):
{common}

A run directory holds config.yaml (resolved), plan.txt, ray_job.sbatch, logs/, checkpoints/, metrics.
"""


# the keys the help names with their docs (launcher.config.schema declares every key's doc)
COMMON_KEYS = ("dry_run", "run.name", "grpo.max_num_steps", "refit.mode", "peft.dim", "peft.alpha",
               "slurm.partition", "slurm.account", "slurm.time_min", "slurm.setup")


def _help() -> str:
    groups = "\n".join(f"  {g:<14} {', '.join(config_mod.group_options(g))}" for g in config_mod.GROUPS)
    common = "\n".join(fields.summary(Config, key) for key in COMMON_KEYS)
    return HELP.format(groups=groups, max_points=sweep_mod.MAX_POINTS, common=common)


def _keys_help(prefixes: list[str]) -> str:
    """`--help SECTION|KEY ...`: each key under them with its type, default, allowed values and doc
    (from the schema); ConfigError naming a prefix that is no key or section."""
    out = []
    for prefix in prefixes:
        text = fields.describe(Config, prefix)
        if not text:
            raise ConfigError(prefix, f"no such key or section; sections: {', '.join(fields.section_docs(Config))}")
        doc = fields.section_docs(Config).get(prefix)
        out.append(f"{prefix}:{' ' + doc if doc else ''}\n{text}")
    return "\n\n".join(out)


_log = logs.get(__name__)
_VERBOSITY = {-1: ["--quiet"], 0: [], 1: ["--verbose"]}   # what a local sweep's point is run with


def _cfg_value(text: str) -> str:
    if text not in ("job", "all"):
        raise argparse.ArgumentTypeError(f"must be job or all, got {text!r} (there is no hydra config to print)")
    return text


def _points(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return int(text)


class _Parser(Parser):
    """The launcher's options; everything else is a Hydra override (key=value). A mistake is the
    one line the launcher always said: the option, what is wrong, no `see --help` suffix."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            first = message.split(": ", 1)[1].split()[0]
            raise ConfigError(first, "not an option; arguments are key=value overrides (see --help)")
        key, _, what = message.partition(": ")
        key = key.removeprefix("argument ").split("/")[0]
        if what == "expected one argument":
            raise ConfigError(key, "needs a value" + (": job or all" if key == "--cfg" else ""))
        raise ConfigError(key, what)


def parser() -> Parser:
    p = _Parser(prog="python -m launcher", add_help=False, allow_abbrev=False)
    p.add_argument("--cfg", "-c", type=_cfg_value, help="job: print the resolved run config; all: and what is derived")
    p.add_argument("-m", "--multirun", action="store_true", help="sweep: one run per point")
    p.add_argument("--max-points", type=_points, default=sweep_mod.MAX_POINTS, help="the most points a sweep may have")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="Hydra overrides: group=option, key=value, +key=value")
    return p


def _options(argv: list[str]) -> argparse.Namespace:
    """The launcher's options and the overrides; ConfigError naming a bad option."""
    return parser().parse_intermixed_args(argv)


@dataclass
class Resolved:
    raw: DictConfig                  # as composed (config_mod.compose), what config.yaml saves
    cfg: Config                      # typed (schema.typed)
    plan: plan_mod.Plan
    run_dir: Path
    spec: sbatch.JobSpec | None      # the Slurm job's (None: a local run)
    on_submission: list = field(default_factory=list)  # a dry run's errors that only a submission raises


def _resolve(overrides: list[str], printing: bool = False) -> tuple[Resolved | None, list]:
    """Compose, validate and plan one run; (the run, []) or (None, its errors). Raises ConfigError."""
    notes: list[str] = []
    raw = config_mod.compose(overrides, notes)  # the model's facts resolved: config.json or the built-in recipe
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    cfg = typed(raw)
    submitting = not (cfg.dry_run or printing)
    errors = validate(cfg, submitting=submitting)
    if errors:
        return None, errors
    # a dry run plans for a cluster whose files may not be here; it says what submitting would refuse
    later = validate(cfg, submitting=True) if cfg.dry_run and not printing else []
    paths.absolute_config(cfg)  # every path absolute, once, before anything reads it
    plan = plan_mod.build(cfg.topology)
    run_dir = paths.run_dir(cfg)
    spec = sbatch.job_spec(cfg, plan) if cfg.topology.executor == "slurm" else None
    return Resolved(raw, cfg, plan, run_dir, spec, later), []


def cfg_text(r: Resolved, which: str) -> str:
    """`--cfg job`: the config as the run's config.yaml holds it; `--cfg all`: then what is derived."""
    text = config_mod.to_yaml(run_dir_mod.resolved(r.raw, r.run_dir))
    if which == "all":
        plan = "".join(f"    {line}\n" for line in r.plan.describe().splitlines())
        text += ("---\n# derived by the launcher (not part of config.yaml)\nlauncher:\n"
                 f"  run_dir: {json.dumps(str(r.run_dir))}\n  executor: {r.cfg.topology.executor}\n"
                 f"  nodes: {len(r.plan.nodes)}\n  plan: |\n{plan}")
    return text


def main(argv: list[str] | None = None) -> int:
    """The command (and its sweep), under launcher.cli.run: every mistake in the options, the
    config, its files or a record read back (a checkpoint to resume) is one line, exit code 2,
    before anything is written or submitted."""
    return cli_mod.run(_main, argv)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        keys = [a for a in argv if a not in ("-h", "--help", "help") and not a.startswith("-") and "=" not in a]
        print(_keys_help(keys) if keys else _help())
        return 0
    try:
        opts = _options(argv)
        overrides = opts.overrides
        if opts.multirun:
            return _multirun(overrides, opts)
        swept = sweep_mod.sweep_override(overrides)
        if swept:
            raise ConfigError(swept, "is a sweep: add -m (--multirun) for one run per value, or quote a value "
                                     "that holds commas: key='a,b'")
        r, errors = _resolve(overrides, printing=bool(opts.cfg))
        if errors:
            for e in errors:
                cli_mod.error(e)
            return 2
        cfg, plan, run_dir, spec = r.cfg, r.plan, r.run_dir, r.spec
        if opts.cfg:
            sys.stdout.write(cfg_text(r, opts.cfg))
            return 0
        if cfg.dry_run:
            _print_dry_run(r)
            return 0
        run_dir_mod.prepare(cfg, r.raw, plan, run_dir, spec)
    except ConfigError as e:
        cli_mod.error(e)
        return 2
    stop_mod.clear_stop_request(run_dir)  # a stop asked of an earlier job of this run is not for this one
    if not cfg.submit:  # any executor: write the run directory, run nothing
        print(run_dir_mod.written(run_dir, spec))
        return 0
    if spec is None:
        return _run_here(cfg, plan, run_dir)
    return _submit(cfg, plan, run_dir)


def _multirun(overrides: list[str], opts: argparse.Namespace) -> int:
    """Every point validated first (one line per problem, naming the point; nothing written or
    submitted if any is bad), then each point written and submitted (or run here, one after another)."""
    points = sweep_mod.expand(overrides, opts.max_points)
    bases, failed = [], {}
    for p in points:
        try:
            bases.append(str(config_mod.compose(p.overrides).run.name))
        except ConfigError as e:
            bases.append("run")
            failed[p.index] = e
    sweep_mod.name_points(points, bases)
    runs, problems = [], []
    for p in points:
        try:
            if p.index in failed:
                raise failed[p.index]
            r, errors = _resolve([*p.overrides, f"run.name='{p.name}'"], printing=bool(opts.cfg))
        except ConfigError as e:
            r, errors = None, [e]
        problems += [(p, e) for e in errors]
        runs.append(r)
    if problems:  # one line per mistake; one mistake: one line
        bad = len({p.index for p, _ in problems})
        for p, e in problems:
            last = "; nothing was written or submitted" if len(problems) == 1 else ""
            cli_mod.error(f"point {p.index} ({p.label()}): {e}{last}")
        if len(problems) > 1:
            cli_mod.error(f"{bad} of {len(points)} sweep point(s) invalid; nothing was written or submitted")
        return 2
    for key in ("dry_run", "submit"):
        if len({getattr(r.cfg, key) for r in runs}) > 1:
            raise ConfigError(key, "cannot differ between the points of a sweep")
    first = runs[0].cfg
    if opts.cfg:
        for p, r in zip(points, runs):
            print(f"# point {p.index}: {p.label()} -> {r.run_dir}")
            sys.stdout.write(cfg_text(r, opts.cfg))
        return 0
    if first.dry_run:
        for p, r in zip(points, runs):
            print(f"\n######## point {p.index}/{len(points)}: {p.label()} -> run {p.name}")
            _print_dry_run(r)
        print(f"\n== sweep of {len(points)} point(s) (dry run: nothing written or submitted)")
        print(sweep_mod.table(points, [{"state": "dry run"}] * len(points)))
        return 0
    for p, r in zip(points, runs):  # refusals (a run that already holds checkpoints...) before any point is written
        try:
            run_dir_mod.check(r.cfg, r.run_dir)
        except ConfigError as e:
            cli_mod.error(f"point {p.index} ({p.label()}): {e}; nothing was written or submitted")
            return 2
    for p, r in zip(points, runs):
        run_dir_mod.prepare(r.cfg, r.raw, r.plan, r.run_dir, r.spec, runs_here=False)
    sdir = sweep_mod.sweep_dir(runs[0].run_dir.parent, bases[0])
    # the sweep's record names every point's overrides (slurm.setup secrets included): the run directory policy
    files.make_dir(sdir, files.Policy(all(r.cfg.run.shared_with_group for r in runs)))
    rows, rc, failures = [], 0, 0
    for p, r in zip(points, runs):
        stop_mod.clear_stop_request(r.run_dir)
        job_id, state = None, "written"
        if rc:
            state = "not submitted" if r.spec is not None else "not run"
        elif r.spec is None:
            _log.info(f"== point {p.index}/{len(points)}: {p.label()}: running here", extra=logs.PLAIN)
            sweep_mod.record(sdir / paths.SWEEP_RECORD, p, r.run_dir, None, "running")
            code = _run_point([*_VERBOSITY[opts.verbosity], *p.overrides, f"run.name='{p.name}'"])
            state = "COMPLETED" if code == 0 else "interrupted" if code == 130 else f"exit {code}"
            rc = 130 if code == 130 else 0  # Ctrl-C ends the sweep; a failed point does not
            failures += code not in (0, 130)
        elif r.cfg.submit:
            try:
                job_id = _submit_job(r.cfg, r.plan, r.run_dir)
                state = "submitted"
            except Exception as e:  # noqa: BLE001 - sbatch refused: say so, submit no further point
                cli_mod.error(f"point {p.index}: submission failed: {_last_line(e)}")
                state, rc = "submission failed", 1
        sweep_mod.record(sdir / paths.SWEEP_RECORD, p, r.run_dir, job_id, state)
        rows.append({"job_id": job_id, "state": state})
    print(sweep_mod.table(points, rows))
    print(f"sweep {sdir} ({len(points)} point(s); record: sweep.jsonl)")
    if first.topology.executor == "slurm" and not first.submit:
        print("submit each with:\n" + "\n".join(f"  {shell.command('sbatch', r.run_dir / paths.SBATCH_SCRIPT)}"
                                                  for r in runs))
    else:
        print(f"follow it: {shell.command('python', '-m', 'launcher.status', sdir, '--watch')}")
    return rc or (1 if failures else 0)


def _run_point(overrides: list[str]) -> int:
    """One point of a local sweep in its own process (its own Ray); Ctrl-C is the child's to handle
    (checkpoint and stop; again: stop now), so this waits for it instead of killing it."""
    proc = subprocess.Popen([sys.executable, "-m", "launcher", *overrides])
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            continue


def _last_line(e: Exception) -> str:
    return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__


def _print_dry_run(r: Resolved) -> None:
    from launcher.job.slurm_job import submitit_folder

    cfg, raw, plan, run_dir, spec = r.cfg, r.raw, r.plan, r.run_dir, r.spec
    print(f"== plan: topology {cfg.topology.name} ({cfg.topology.executor}, {len(plan.nodes)} node(s))")
    print(plan.describe())
    print(memory.plan_memory(cfg, plan).describe())
    if costs := refit_cost.describe(cfg):
        print(costs)
    print(f"\n== resolved config (would be written to {run_dir}/config.yaml)")
    print(config_mod.to_yaml(run_dir_mod.resolved(raw, run_dir)).rstrip())
    for e in r.on_submission:  # files that are not on this machine (model, data, reward)
        print(f"\nnote: a submission from this machine would stop here: {e}")
    if (note := run_dir_mod.resume_note(cfg, run_dir)) is not None:
        print(f"\nnote: {note}")
    if spec is None:
        print("\n== executor local: runs in this process on this machine (no sbatch script)")
    else:
        print(f"\n== sbatch script submitit would submit (folder {submitit_folder(run_dir)})")
        print(sbatch.submitit_script(spec, run_dir))
        print(f"== also written on submission: {run_dir}/ray_job.sbatch (the same job for plain `sbatch`)")


def _submit_job(cfg, plan, run_dir: Path) -> str:
    from launcher.job.submit import submit_slurm

    job = submit_slurm(cfg, plan, run_dir)
    run_dir_mod.record_submission(run_dir, job.job_id)
    return job.job_id


def _submit(cfg, plan, run_dir: Path) -> int:
    try:
        job_id = _submit_job(cfg, plan, run_dir)
    except Exception as e:  # sbatch refused (bad partition, no Slurm...): say what Slurm said
        cli_mod.error(f"submission failed: {_last_line(e)}")
        return 1
    log, _ = slurm_job.task_logs(run_dir, job_id)
    print(f"submitted job {job_id} ({len(plan.nodes)} nodes) for run {cfg.run.name}")
    print(f"  run directory: {run_dir}")
    print(f"  follow the driver: {shell.command('tail', '-F', log)}")
    status = shell.command('python', '-m', 'launcher.status', run_dir)
    print(f"  Ray logs per node: {run_dir}/logs/   status: {status}")
    print(f"  stop after a checkpoint: {shell.command('python', '-m', 'launcher.stop', run_dir)}   cancel now: "
          f"{shell.command('scancel', job_id)}")
    return 0


def _run_here(cfg, plan, run_dir: Path) -> int:
    from launcher.cluster import restarts
    from launcher.cluster.context import ClusterError
    from launcher.job.submit import run_local

    log = _log.info

    log(f"run directory {run_dir}")
    t0 = time.time()
    attempt = 0
    try:
        # to the end of the run one Ctrl-C finishes the step and saves, whatever phase it lands in: the
        # start-up, a step, the save, the clean-up, a restart (cluster.stop.armed); a second one stops at once
        with stop_mod.armed(stop_mod.local_handlers()):
            while True:
                try:
                    out = run_local(cfg, plan, run_dir, attempt=attempt)
                    result = out.get("result") or {}
                    break
                except ClusterError as e:
                    cli_mod.error(e)
                    n = restarts.after_failure(cfg, run_dir, f"local-{os.getpid()}", e)
                    if n is None or stop_mod.stopping():  # asked to stop: no restart
                        return 1
                    attempt = n
                    cfg.resume = restarts.resume_after_requeue(cfg, run_dir)
                    log(f"{restarts.restart_line(cfg, n)} from "
                        f"{cfg.resume or 'the beginning (no complete checkpoint yet)'}")
    except KeyboardInterrupt:  # the second Ctrl-C
        # a further Ctrl-C while the interpreter exits (Ray's atexit hooks, daemon threads) would end it
        # by the signal (exit -2) instead of 130: stopping was already asked for
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("interrupted: stopped at once (no checkpoint); Ray and vLLM processes are stopped", file=sys.stderr)
        return 130
    if result.get("stopped"):
        asked = out.get("stop_requested")  # python -m launcher.stop: what was asked for, not an interruption
        print(closing_line(result, bool(asked)), file=sys.stderr)
        return 0 if asked else 130
    log(f"finished in {time.time() - t0:.0f}s; everything is in {run_dir}")
    return 0


def closing_line(result: dict, asked: bool = False) -> str:
    """What a stopped local run says last: the step it stopped at and what continues it, as the
    driver reports it (launcher.driver.grpo.outcome: the checkpoint it saved or resumed from)."""
    step, ckpt = result["step"], result.get("checkpoint", result["step"])
    how = f"stopped{' on request' if asked else ''} at step {step}"
    if ckpt is None:
        if step == 0:
            return f"{how}: nothing was saved (before step 1); the same command starts the run again from step 1"
        # its metrics rows stay: a fresh launch under this run.name is refused (launcher.job.run_dir.check)
        return (f"{how}: nothing was saved (checkpointing.enabled=false); the same command with "
                f"run.name=<new name> starts it again from step 1")
    if ckpt == step and result.get("saved", True):
        return f"{how} after saving a checkpoint; continue with the same command and +resume=latest"
    if ckpt == step:
        return (f"{how}, before running a step: nothing new was saved; the same command continues from "
                f"that checkpoint (step_{step}) again")
    return (f"{how}; the newest checkpoint is step_{ckpt} (checkpointing.enabled=false): continue with the same "
            f"command and +resume=latest, which runs steps {ckpt + 1}-{step} again")


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
