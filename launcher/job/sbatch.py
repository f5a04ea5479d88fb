"""What the job asks Slurm for, in one place: submitit's parameters and the sbatch template.

`job_spec(cfg, plan)` turns the config into the job's Slurm request and rejects any value
that would break a script (newline, NUL, unbalanced quote). A job on cuda takes whole nodes
(--exclusive --mem=0); topology.nvlink_domain_nodes becomes --segment and, above one node,
NCCL_MNNVL_ENABLE=1. From that one spec come `submitit_parameters` (what the launcher submits),
`submitit_script` (the exact text submitit writes, for the dry run) and `render`
(sbatch/ray_job.sbatch.j2, for people who use sbatch).
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from launcher import paths
from launcher import plan as plan_mod
from launcher.config.schema import Config, ConfigError

TEMPLATE = Path(__file__).resolve().parents[2] / "sbatch" / "ray_job.sbatch.j2"
_FLAG = re.compile(r"^[a-z][a-z0-9_-]*$")

SBATCH_OUTPUT = "the launcher reads the job id from what sbatch prints"
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
    "segment": "set topology.nvlink_domain_nodes",
    # what sbatch prints or whether it returns: the launcher reads the job id from its output (submitit and the
    # plain-sbatch path alike) and records it for the run directory's guard; these would queue a job whose id
    # is never recorded, queue none, or block until the job ends
    "parsable": SBATCH_OUTPUT, "quiet": SBATCH_OUTPUT, "verbose": SBATCH_OUTPUT, "test-only": SBATCH_OUTPUT,
    "wait": "the launcher submits and returns; follow the job with python -m launcher.status --watch",
    "help": SBATCH_OUTPUT, "usage": SBATCH_OUTPUT, "version": SBATCH_OUTPUT,
}
# ... and, for a job that takes its nodes whole (owns_whole_nodes), the options that say so; --mem, --mem-per-cpu
# and --mem-per-gpu exclude one another in sbatch, so the other two are the launcher's as well
WHOLE_NODE = "a Slurm job on cuda takes whole nodes: --exclusive --mem=0"
NOT_WITH_MEM = "a Slurm job on cuda takes whole nodes with --mem=0, which sbatch does not combine with this"
MANAGED_WHOLE_NODE = {"exclusive": WHOLE_NODE, "mem": WHOLE_NODE, "mem-per-cpu": NOT_WITH_MEM,
                      "mem-per-gpu": NOT_WITH_MEM}

# What --segment needs of the cluster, said by the dry run and the scripts (Slurm's sbatch(1), topology.html)
SEGMENT_NEEDS = ("--segment={n} needs Slurm >= 24.05 with TopologyPlugin=topology/block and the NVL72 racks declared "
                 "as blocks in topology.conf (BlockName=... Nodes=...): an older sbatch refuses the option, a cluster "
                 "without a block topology ignores it")


@dataclass
class JobSpec:
    """The job's Slurm request with every value raw (unquoted); each renderer quotes it once."""
    job_name: str
    nodes: int
    gpus_per_node: int
    cpus_per_task: int | None
    time_min: int
    signal_delay_s: int
    flags: dict[str, object] = field(default_factory=dict)   # partition, account, qos, topology's, extra_sbatch
    setup: list[str] = field(default_factory=list)           # shell lines, run as written
    env: dict[str, str] = field(default_factory=dict)        # exported before setup (which may override them)
    notes: list[str] = field(default_factory=list)           # one line each, a comment in both scripts
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


def owns_whole_nodes(cfg: Config) -> bool:
    """Whether the job takes its nodes whole (#SBATCH --exclusive --mem=0): a Slurm job on cuda. The config
    does not say how many GPUs a node has, so a cuda job is taken to ask for all of them."""
    return cfg.topology.executor == "slurm" and cfg.topology.device == "cuda"


def managed(cfg: Config) -> dict[str, str]:
    """The sbatch options the launcher sets for `cfg`'s job, each with what to do instead."""
    return {**MANAGED, **(MANAGED_WHOLE_NODE if owns_whole_nodes(cfg) else {})}


def managed_option(key: str, options: dict[str, str] = MANAGED) -> str | None:
    """The launcher-managed sbatch option (of `options`) that `key` is or abbreviates, else None."""
    k = key.replace("_", "-")
    hits = [m for m in options if m.startswith(k)]
    return (k if k in options else min(hits, key=len)) if hits else None


def _extra_flag(key: str, value: object, options: dict[str, str] = MANAGED) -> tuple[str, object]:
    where = f"slurm.extra_sbatch.{key}"
    if not _FLAG.match(str(key)):
        raise ConfigError(where, "not an sbatch long option name (lower-case letters, digits, - and _)")
    option = managed_option(str(key), options)
    if option is not None:
        what = "is" if option == str(key).replace("_", "-") else f"abbreviates --{option}, which is"
        raise ConfigError(where, f"{what} set by the launcher ({options[option]})")
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
    if owns_whole_nodes(cfg):
        flags.update(exclusive=True, mem="0")  # every core, GPU and byte of memory of each node
    env, notes = {}, []
    domain = cfg.topology.nvlink_domain_nodes
    if domain is not None:
        if domain < 1 or len(plan.nodes) % domain:
            raise ConfigError("topology.nvlink_domain_nodes",
                              f"must divide the job's {len(plan.nodes)} nodes (topology.nodes; sbatch --segment=N "
                              f"allocates them in groups of N, each inside one topology block), got {domain}")
        # topology/block: the nodes come in segments of `domain`, each segment inside one block (an NVL72 rack);
        # different segments may land in different blocks
        flags["segment"] = domain
        notes.append(SEGMENT_NEEDS.format(n=domain))
        if domain > 1:
            env["NCCL_MNNVL_ENABLE"] = "1"  # NCCL over multi-node NVLink, or fail at init (not fall back to IB)
    options = managed(cfg)
    for key, value in s.extra_sbatch.items():
        name, value = _extra_flag(str(key), value, options)
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
                   env=env, notes=notes, srun_args=srun_args, python=python)


# the shell options of both scripts, before anything of the job's runs: a setup line that fails, reads an unset
# variable or fails inside a pipe stops the job there (with its status), before Ray starts on a broken environment
SHELL_OPTIONS = "set -euo pipefail"


def prologue(spec: JobSpec) -> list[str]:
    """The shell lines both scripts run after SHELL_OPTIONS and before the job's srun, from this one
    place: the plain-sbatch template (`render`) pastes them, submitit gets them as its `setup`
    (behind SHELL_OPTIONS, which the template writes first), so the same slurm.setup behaves the same
    on both paths (tests/unit/test_plan_and_sbatch.py runs both bodies)."""
    lines = []
    if topology_lines(spec):
        lines += ["# the NVLink domain (topology.nvlink_domain_nodes); slurm.setup, run next, may override",
                  *topology_lines(spec)]
    if spec.setup:
        lines += ["# setup (slurm.setup)", *spec.setup]
    return lines


def topology_lines(spec: JobSpec) -> list[str]:
    """The shell lines both scripts run before slurm.setup (which may override them): the notes as
    comments, then the job's environment (srun passes it to every task, Ray to every actor)."""
    return [f"# note: {n}" for n in spec.notes] + [f"export {k}={shlex.quote(v)}" for k, v in spec.env.items()]


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
                        signal_delay_s=spec.signal_delay_s, setup=[SHELL_OPTIONS, *prologue(spec)],
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
        log_q=shlex.quote(str(run_dir / "logs" / "sbatch-%j.out")), shell_options=SHELL_OPTIONS,
        prologue=prologue(spec),
        srun_args=[shlex.quote(a) for a in srun_args(spec, run_dir)], python=spec.python_q)
