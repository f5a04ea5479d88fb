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

from launcher import plan as plan_mod
from launcher.config.compose import ConfigError
from launcher.config.schema import Config

TEMPLATE = Path(__file__).resolve().parents[2] / "sbatch" / "ray_job.sbatch.j2"
_FLAG = re.compile(r"^[a-z][a-z0-9_-]*$")


@dataclass
class JobSpec:
    job_name: str
    nodes: int
    gpus_per_node: int
    cpus_per_task: int | None
    time_min: int
    signal_delay_s: int
    flags: dict[str, object] = field(default_factory=dict)   # partition, account, qos, extra_sbatch
    setup: list[str] = field(default_factory=list)
    srun_args: list[str] = field(default_factory=list)
    python: str = sys.executable


def _one_line(key: str, value: object) -> str:
    text = str(value)
    for ch, name in (("\n", "a newline"), ("\r", "a carriage return"), ("\0", "a NUL byte")):
        if ch in text:
            raise ConfigError(key, f"contains {name}; a value must be a single line")
    try:
        shlex.split(text)
    except ValueError:
        raise ConfigError(key, f"has an unbalanced quote: {text!r}") from None
    return text


def job_spec(cfg: Config, plan: plan_mod.Plan) -> JobSpec:
    s = cfg.slurm
    flags: dict[str, object] = {}
    for key in ("partition", "account", "qos"):
        if getattr(s, key) is not None:
            flags[key] = _one_line(f"slurm.{key}", getattr(s, key))
    for key, value in s.extra_sbatch.items():
        if not _FLAG.match(str(key)) or key in ("nodes", "ntasks_per_node", "ntasks-per-node", "output", "signal"):
            raise ConfigError(f"slurm.extra_sbatch.{key}", "not an sbatch option this launcher lets you set "
                                                           "(nodes, tasks, output and signal come from the config)")
        flags[str(key).replace("_", "-")] = True if value is True else _one_line(f"slurm.extra_sbatch.{key}", value)
    srun_args = []
    if s.container_image:
        srun_args.append("--container-image=" + shlex.quote(_one_line("slurm.container_image", s.container_image)))
    if s.container_mounts:
        srun_args.append("--container-mounts=" + shlex.quote(_one_line("slurm.container_mounts", s.container_mounts)))
    setup = [_one_line(f"slurm.setup[{i}]", line) for i, line in enumerate(s.setup)]
    python = _one_line("slurm.python", s.python) if s.python else shlex.quote(sys.executable)
    return JobSpec(job_name=_one_line("run.name", cfg.run.name), nodes=len(plan.nodes),
                   gpus_per_node=cfg.topology.gpus_per_node, cpus_per_task=cfg.topology.cpus_per_node,
                   time_min=s.time_min, signal_delay_s=s.signal_delay_s, flags=flags, setup=setup,
                   srun_args=srun_args, python=python)


def submitit_parameters(spec: JobSpec) -> dict:
    """Parameters for submitit.SlurmExecutor.update_parameters."""
    params: dict = dict(job_name=spec.job_name, nodes=spec.nodes, ntasks_per_node=1, time=spec.time_min,
                        signal_delay_s=spec.signal_delay_s, setup=list(spec.setup),
                        srun_args=["--kill-on-bad-exit=1", *spec.srun_args])
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
    """The command submitit's SlurmExecutor puts after srun (see SlurmExecutor._submitit_command_str)."""
    return " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])


def submitit_script(spec: JobSpec, folder: Path) -> str:
    """The exact sbatch text submitit would write for this job (no Slurm contacted).

    `_make_sbatch_string` is submitit's private renderer, but it is the very function
    SlurmExecutor.submit uses: the dry run shows what would be submitted, not an imitation."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=submitit_command(spec.python, folder), folder=folder,
                               **submitit_parameters(spec))


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
        srun_args=spec.srun_args, python=spec.python)
