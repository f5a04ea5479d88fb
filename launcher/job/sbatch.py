"""What the job asks Slurm for, in one place: submitit's parameters and the sbatch template.

`job_spec(cfg, plan)` turns the config into the job's Slurm request and rejects any value
that would break a script (newline, NUL, unbalanced quote). From that one spec come
`submitit_parameters` (what the launcher submits), `submitit_script` (the exact text submitit
writes, for the dry run) and `render` (sbatch/ray_job.sbatch.j2, for people who use sbatch).
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from launcher import paths
from launcher import plan as plan_mod
from launcher.config.compose import ConfigError
from launcher.config.schema import Config

TEMPLATE = Path(__file__).resolve().parents[2] / "sbatch" / "ray_job.sbatch.j2"
_FLAG = re.compile(r"^[a-z][a-z0-9_-]*$")

# sbatch options the launcher sets itself, with the config key to use instead. sbatch accepts any
# unambiguous prefix of a long option (`--ntasks-per-nod`), so a key that is a prefix of one of
# these is refused too: extra_sbatch can only add options, never change the job both paths submit.
MANAGED = {
    "job-name": "set run.name", "nodes": "set topology.nodes (the plan's node count)",
    "ntasks": "the job runs one task per node", "ntasks-per-node": "the job runs one task per node",
    "tasks-per-node": "the job runs one task per node", "gpus-per-node": "set topology.gpus_per_node",
    "gpus": "set topology.gpus_per_node", "gpus-per-task": "set topology.gpus_per_node",
    "cpus-per-task": "set topology.cpus_per_node", "time": "set slurm.time_min",
    "signal": "set slurm.signal_delay_s", "output": "logs go to the run directory",
    "error": "logs go to the run directory", "open-mode": "logs are appended across requeues",
    "array": "a run is one job", "chdir": "the job works in the run directory",
    "export": "set variables with slurm.setup='[export VAR=value]'", "partition": "set slurm.partition",
    "account": "set slurm.account", "qos": "set slurm.qos", "requeue": "the launcher requeues the job itself",
    "no-requeue": "set retry.max_restarts=0 and slurm.max_num_timeout=0",
    "wrap": "the job script is the launcher's", "container-image": "set slurm.container_image",
    "container-mounts": "set slurm.container_mounts",
}


@dataclass
class JobSpec:
    """The job's Slurm request with every value raw (unquoted); each renderer quotes it once."""
    job_name: str
    nodes: int
    gpus_per_node: int
    cpus_per_task: int | None
    time_min: int
    signal_delay_s: int
    flags: dict[str, object] = field(default_factory=dict)   # partition, account, qos, extra_sbatch
    setup: list[str] = field(default_factory=list)           # shell lines, run as written
    srun_args: list[str] = field(default_factory=list)       # argv words for srun
    python: str = sys.executable                             # one executable path

    @property
    def python_q(self) -> str:
        return shlex.quote(self.python)


def _one_line(key: str, value: object) -> str:
    """`value` as a single line with balanced quotes (setup lines are pasted into the script)."""
    text = str(value)
    for ch, name in (("\n", "a newline"), ("\r", "a carriage return"), ("\0", "a NUL byte")):
        if ch in text:
            raise ConfigError(key, f"contains {name}; a value must be a single line")
    try:
        shlex.split(text)
    except ValueError:
        raise ConfigError(key, f"has an unbalanced quote: {text!r}") from None
    return text


def managed_option(key: str) -> str | None:
    """The launcher-managed sbatch option that `key` is or abbreviates, else None."""
    k = key.replace("_", "-")
    hits = [m for m in MANAGED if m.startswith(k)]
    return (k if k in MANAGED else min(hits, key=len)) if hits else None


def _extra_flag(key: str, value: object) -> tuple[str, object]:
    where = f"slurm.extra_sbatch.{key}"
    if not _FLAG.match(str(key)):
        raise ConfigError(where, "not an sbatch long option name (lower-case letters, digits, - and _)")
    option = managed_option(str(key))
    if option is not None:
        what = "is" if option == str(key).replace("_", "-") else f"abbreviates --{option}, which is"
        raise ConfigError(where, f"{what} set by the launcher ({MANAGED[option]})")
    if value is True:
        return str(key).replace("_", "-"), True
    if value is False or value is None or isinstance(value, (dict, list)):
        raise ConfigError(where, f"must be a string, a number or true (a flag), got {value!r}")
    return str(key).replace("_", "-"), _one_line(where, value)


def job_spec(cfg: Config, plan: plan_mod.Plan) -> JobSpec:
    s = cfg.slurm
    flags: dict[str, object] = {}
    for key in ("partition", "account", "qos"):
        if getattr(s, key) is not None:
            flags[key] = _one_line(f"slurm.{key}", getattr(s, key))
    for key, value in s.extra_sbatch.items():
        name, value = _extra_flag(str(key), value)
        flags[name] = value
    srun_args = []
    if cfg.topology.cpus_per_node:
        # Slurm >= 22.05: srun no longer inherits sbatch's --cpus-per-task (nor reads SLURM_CPUS_PER_TASK);
        # without it the step that runs Ray on each node would get one core
        srun_args.append(f"--cpus-per-task={int(cfg.topology.cpus_per_node)}")
    if s.container_image:
        srun_args.append("--container-image=" + _one_line("slurm.container_image", s.container_image))
    if s.container_mounts:
        srun_args.append("--container-mounts=" + _one_line("slurm.container_mounts", s.container_mounts))
    setup = [_one_line(f"slurm.setup[{i}]", line) for i, line in enumerate(s.setup)]
    python = _one_line("slurm.python", s.python) if s.python else sys.executable
    return JobSpec(job_name=_one_line("run.name", cfg.run.name), nodes=len(plan.nodes),
                   gpus_per_node=cfg.topology.gpus_per_node, cpus_per_task=cfg.topology.cpus_per_node,
                   time_min=s.time_min, signal_delay_s=s.signal_delay_s, flags=flags, setup=setup,
                   srun_args=srun_args, python=python)


def srun_args(spec: JobSpec, run_dir: Path) -> list[str]:
    """The step's srun words (raw) after --kill-on-bad-exit and --ntasks-per-node, for both paths: first the
    task epilog, run on every node once its task ended, however it ended (the node's Ray temp dir goes: a
    cancelled step kills the reaper that would have removed it), then the config's (job_spec)."""
    return [f"--task-epilog={Path(run_dir) / paths.TASK_EPILOG}", *spec.srun_args]


def task_epilog_script(spec: JobSpec, run_dir: Path) -> str:
    """RUN/task_epilog.sh, srun's --task-epilog (job_spec): Slurm runs it on every node once the job's task
    there ended, however it ended, with the task's environment (launcher.cluster.task_epilog)."""
    return ("#!/bin/sh\n# srun --task-epilog: run by Slurm on every node once the job's task there has ended, however "
            "it ended;\n# it removes the node's Ray temp dir and keeps its logs (launcher.cluster.task_epilog)\n"
            f"exec {spec.python_q} -m launcher.cluster.task_epilog {shlex.quote(str(run_dir))}\n")


def submitit_parameters(spec: JobSpec, run_dir: Path) -> dict:
    """Parameters for submitit.SlurmExecutor.update_parameters (submitit quotes srun's words itself)."""
    params: dict = dict(job_name=spec.job_name, nodes=spec.nodes, ntasks_per_node=1, time=spec.time_min,
                        signal_delay_s=spec.signal_delay_s, setup=list(spec.setup),
                        srun_args=["--kill-on-bad-exit=1", *srun_args(spec, run_dir)])
    if spec.gpus_per_node:
        params["gpus_per_node"] = spec.gpus_per_node
    if spec.cpus_per_task:
        params["cpus_per_task"] = spec.cpus_per_task
    extra = dict(spec.flags)
    for key in ("partition", "account", "qos"):
        if key in extra:
            params[key] = extra.pop(key)
    if extra:
        params["additional_parameters"] = extra
    return params


def submitit_command(python: str, folder: Path) -> str:
    """The command submitit's SlurmExecutor puts after srun (see SlurmExecutor._submitit_command_str):
    `python` is pasted as is, so it is passed already quoted (JobSpec.python_q)."""
    return " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])


def submitit_script(spec: JobSpec, run_dir: Path) -> str:
    """The exact sbatch text submitit would write for this job (no Slurm contacted).

    `_make_sbatch_string` is submitit's private renderer, but it is the very function
    SlurmExecutor.submit uses: the dry run shows what would be submitted, not an imitation."""
    from submitit.slurm.slurm import _make_sbatch_string

    from launcher.job.slurm_job import submitit_folder

    folder = submitit_folder(run_dir)
    return _make_sbatch_string(command=submitit_command(spec.python_q, folder), folder=folder,
                               **submitit_parameters(spec, run_dir))


def render(spec: JobSpec, plan: plan_mod.Plan, run_dir: Path, header: str = "") -> str:
    """sbatch/ray_job.sbatch.j2 rendered for this run: `sbatch RUN/ray_job.sbatch` works as is."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    template = env.from_string(TEMPLATE.read_text())
    flags = [f"--{k}" if v is True else f"--{k}={shlex.quote(str(v))}" for k, v in spec.flags.items()]
    run_dir_q = shlex.quote(str(run_dir))
    return template.render(
        header=header or f"GRPO LoRA job {spec.job_name}", run_dir_q=run_dir_q,
        plan_lines=plan.describe().splitlines(), job_name=shlex.quote(spec.job_name), nodes=spec.nodes,
        gpus_per_node=spec.gpus_per_node, cpus_per_task=spec.cpus_per_task, time_min=spec.time_min,
        slurm_flags=flags, signal_delay_s=spec.signal_delay_s,
        log_q=shlex.quote(str(run_dir / "logs" / "sbatch-%j.out")), setup=spec.setup,
        srun_args=[shlex.quote(a) for a in srun_args(spec, run_dir)], python=spec.python_q)
