"""Every command ends a user mistake in one line and exit code 2, before it does any work (launcher/cli.py).

One table, one row per mistake: the command (`launcher`, its sweep `-m`, `launcher.export`,
`launcher.status`, `launcher.stop`), its arguments, the files set up first, and the start of the
one stderr line. After the mistake nothing under the sandbox may have changed (no adapter half
written, no stop request, no sweep folder) and nothing is printed on stdout. Adding a case is one
line in CASES. The `python -m` entry points themselves are run once each for the issue's case.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from launcher import __main__ as launcher_cli
from launcher import export, status, stop

SB = "{sandbox}"
MAINS = {"launcher": launcher_cli.main, "sweep": launcher_cli.main, "export": export.main, "status": status.main,
         "stop": stop.main}


@dataclass
class Mistake:
    command: str
    name: str
    argv: list[str]
    message: str                                  # the start of stderr's only line, after "error: "
    setup: Callable[[Path], None] | None = None


# ------------------------------------------------------------------------------- what the cases set up
def run_dir(name: str = "r", *extra: str):
    """A run directory as a submission writes it (submit=false, local topology)."""
    def setup(sb: Path) -> None:
        assert launcher_cli.main(["submit=false", f"run.root={sb}/runs", f"run.name={name}", *extra]) == 0
    return setup


def running(name: str = "r"):
    """A local run whose process (this test's) is alive."""
    def setup(sb: Path) -> None:
        from launcher import files

        run_dir(name)(sb)
        files.make_dir(sb / "runs" / name / "ray" / f"local-{os.getpid()}.0")
    return setup


def with_file(setup, rel: str, text: str):
    """`setup`, then a file of the run written over (a record that is not what the launcher writes)."""
    def both(sb: Path) -> None:
        setup(sb)
        (sb / "runs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (sb / "runs" / rel).write_text(text)
    return both


def sweep(line: dict | str):
    def setup(sb: Path) -> None:
        d = sb / "runs" / "sweeps" / "s"
        d.mkdir(parents=True)
        (d / "sweep.jsonl").write_text((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return setup


POINT = {"point": 0, "overrides": ["peft.dim=8"], "swept": {"peft.dim": "8"}, "run_name": "r", "run_dir": "/tmp/x",
         "job_id": None, "state": "written", "time": "T"}


def checkpoint(info: dict | None = None, config: str | None = None, out: str | None = None):
    """A run checkpoint {sandbox}/ck/step_1 (records forged with a manifest to match), and
    optionally a file at `out` (relative to the sandbox)."""
    def setup(sb: Path) -> None:
        from tests.helpers.checkpoints import checkpoint as make, rewrite_manifest

        ck = make(sb / "ck", 1)
        if info is not None:
            (ck / "training_info.json").write_text(json.dumps(info))
        if config is not None:
            (ck / "config.yaml").write_text(config)
        if info is not None or config is not None:
            rewrite_manifest(ck)
        if out is not None:
            (sb / out).parent.mkdir(parents=True, exist_ok=True)
            (sb / out).write_text("mine")
    return setup


CK = ["--checkpoint", f"{SB}/ck/step_1"]
EXPORT_HELP = "; see python -m launcher.export --help"
CASES = [
    # python -m launcher.export: the arguments, --out, the name, the checkpoint and its records, the base model
    Mistake("export", "no-arguments", [], "python -m launcher.export: the following arguments are required: "
            "--checkpoint, --out" + EXPORT_HELP),
    Mistake("export", "unknown-option", [*CK, "--out", f"{SB}/a", "--bogus"],
            "python -m launcher.export: unrecognized arguments: --bogus"),
    Mistake("export", "out-is-a-file", [*CK, "--out", f"{SB}/adapter"],
            f"--out {SB}/adapter: exists and is not a directory", checkpoint(out="adapter")),
    Mistake("export", "out-holds-other-files", [*CK, "--out", f"{SB}/home"],
            f"--out {SB}/home: holds other files (notes.txt)", checkpoint(out="home/notes.txt")),
    Mistake("export", "out-below-a-file", [*CK, "--out", f"{SB}/adapter/x"], f"--out {SB}/adapter/x: {SB}/adapter "
            "is not a directory", checkpoint(out="adapter")),
    Mistake("export", "name-with-space", [*CK, "--out", f"{SB}/a", "--name", "my adapter"],
            "--name 'my adapter': must be one word", checkpoint()),
    Mistake("export", "name-with-equals", [*CK, "--out", f"{SB}/a", "--name", "a=b"], "--name 'a=b': must be one word",
            checkpoint()),
    Mistake("export", "no-checkpoint", ["--checkpoint", f"{SB}/nope", "--out", f"{SB}/a"],
            f"{SB}/nope: no such checkpoint directory"),
    Mistake("export", "negative-step", [*CK, "--out", f"{SB}/a"],
            f"{SB}/ck/step_1/training_info.json: step: must be an integer >= 0, got -5",
            checkpoint(info={"step": -5, "consumed_prompts": -1})),
    Mistake("export", "step-of-another-folder", [*CK, "--out", f"{SB}/a"],
            f"{SB}/ck/step_1/training_info.json: step: 2, but the folder is step_1",
            checkpoint(info={"step": 2, "consumed_prompts": 0})),
    Mistake("export", "config-python-tag", [*CK, "--out", f"{SB}/a"],
            f"{SB}/ck/step_1/config.yaml: not a config this launcher writes (could not determine a constructor",
            checkpoint(config="model: !!python/object/apply:os.system ['touch /tmp/i26-pwned']\n")),
    Mistake("export", "no-base-model", [*CK, "--out", f"{SB}/a", "--base-model", f"{SB}/nobase"],
            f"{SB}/nobase: no config.json, not an HF model directory (from --base-model)", checkpoint()),
    # python -m launcher.status: the arguments, the runs named, and every record it reads
    Mistake("status", "watch-not-a-number", ["--watch=x"], "--watch: seconds (a number > 0), got 'x'"),
    Mistake("status", "watch-zero", ["--watch", "0"], "--watch: seconds (a number > 0), got '0'"),
    Mistake("status", "unknown-option", ["--bogus"], "python -m launcher.status: unrecognized arguments: --bogus"),
    Mistake("status", "no-such-dir", [f"{SB}/nope"], f"{SB}/nope: does not exist"),
    Mistake("status", "bad-run-name", ["run.name=../x", f"run.root={SB}/runs"], "run.name: must be one path component"),
    Mistake("status", "config-python-tag", [f"{SB}/runs/r"], f"{SB}/runs/r/config.yaml: not a config this launcher "
            "writes", with_file(run_dir(), "r/config.yaml", "run: !!python/name:os.system\n")),
    Mistake("status", "config-bad-type", [f"{SB}/runs/r"], f"{SB}/runs/r/config.yaml: grpo.max_num_steps: expected "
            "an integer, got 'many'", with_file(run_dir(), "r/config.yaml", "grpo:\n  max_num_steps: many\n")),
    Mistake("status", "failures-line", [f"{SB}/runs/r"], f"{SB}/runs/r/failures.jsonl line 1: job: is missing",
            with_file(run_dir(), "r/failures.jsonl", '{"time": "T", "error": "x"}\n')),
    Mistake("status", "submissions-line", [f"{SB}/runs/r"], f"{SB}/runs/r/submissions.jsonl line 2: not valid JSON",
            with_file(run_dir(), "r/submissions.jsonl", '{"time": "T", "job_id": "1"}\n{"time": \n')),
    Mistake("status", "stopped-not-json", [f"{SB}/runs/r"], f"{SB}/runs/r/stopped.json: not valid JSON",
            with_file(run_dir(), "r/stopped.json", "stopped at step 3")),
    Mistake("status", "stopped-step-negative", [f"{SB}/runs/r"], f"{SB}/runs/r/stopped.json: step: must be an integer "
            ">= 0, got -1", with_file(run_dir(), "r/stopped.json", json.dumps(
                {"time": "T", "job": "1", "step": -1, "stopped": True, "requested": {}}))),
    Mistake("status", "done-ok-text", [f"{SB}/runs/r"], f"{SB}/runs/r/ray/local-1.0/done: ok: must be true or false",
            with_file(run_dir(), "r/ray/local-1.0/done", '{"ok": "yes"}')),
    Mistake("status", "sweep-relative-run-dir", [f"{SB}/runs/sweeps/s"], f"{SB}/runs/sweeps/s/sweep.jsonl line 1: "
            "run_dir: must be an absolute path, got '../../etc'", sweep({**POINT, "run_dir": "../../etc"})),
    Mistake("status", "sweep-point-negative", [f"{SB}/runs/sweeps/s"], f"{SB}/runs/sweeps/s/sweep.jsonl line 1: "
            "point: must be an integer >= 0, got -1", sweep({**POINT, "point": -1})),
    Mistake("status", "sweep-run-name", [f"{SB}/runs/sweeps/s"], f"{SB}/runs/sweeps/s/sweep.jsonl line 1: run_name: "
            "must be one path component", sweep({**POINT, "run_name": "../r"})),
    # python -m launcher.stop: the arguments, the directory, every record it reads - before any job is asked
    Mistake("stop", "no-arguments", [], "python -m launcher.stop: the following arguments are required: "
            "RUN_DIR|SWEEP_DIR"),
    Mistake("stop", "two-dirs", [f"{SB}/runs/r", f"{SB}/runs/q"], "python -m launcher.stop: unrecognized arguments"),
    Mistake("stop", "timeout-text", [f"{SB}/runs/r", "--timeout", "soon"], "--timeout: seconds (a number > 0), got "
            "'soon'"),
    Mistake("stop", "timeout-nan", [f"{SB}/runs/r", "--timeout=nan"], "--timeout: seconds (a number > 0), got 'nan'"),
    Mistake("stop", "timeout-zero", [f"{SB}/runs/r", "--timeout=0"], "--timeout: seconds (a number > 0), got '0'"),
    Mistake("stop", "not-a-run", [f"{SB}"], f"{SB}: not a run directory (no config.yaml) nor a sweep directory"),
    Mistake("stop", "sweep-bad-line", [f"{SB}/runs/sweeps/s"], f"{SB}/runs/sweeps/s/sweep.jsonl line 1: swept: must "
            "be an object, got list", sweep({**POINT, "swept": ["peft.dim"]})),
    Mistake("stop", "config-unknown-key", [f"{SB}/runs/r", "--no-wait"], f"{SB}/runs/r/config.yaml: grpo.steps: "
            "unknown key", with_file(running(), "r/config.yaml", "grpo:\n  steps: 3\n")),
    Mistake("stop", "failures-not-json", [f"{SB}/runs/r", "--no-wait"], f"{SB}/runs/r/failures.jsonl line 1: not "
            "valid JSON", with_file(running(), "r/failures.jsonl", "node 1 left\n")),
    # python -m launcher: options, overrides, a checkpoint to resume (more: test_hostile_inputs.py)
    Mistake("launcher", "cfg-value", ["--cfg", "hydra"], "--cfg: must be job or all"),
    Mistake("launcher", "max-points-text", ["--max-points", "x", "-m", "peft.dim=8"], "--max-points: must be a "
            "positive whole number"),
    Mistake("launcher", "unknown-key", ["peft.dimm=8", f"run.root={SB}/runs"], "peft.dimm: unknown key"),
    Mistake("launcher", "resume-forged", [f"+resume={SB}/ck/step_1", f"run.root={SB}/runs"],
            f"resume: {SB}/ck/step_1/training_info.json: consumed_prompts: must be an integer >= 0, got -1",
            checkpoint(info={"step": 1, "consumed_prompts": -1})),
    # the sweep: every point validated, one line for one mistake, nothing written
    Mistake("sweep", "one-bad-point", ["-m", "peft.dim=8,abc", f"run.root={SB}/runs", "submit=false"],
            "point 1 (peft.dim=abc): peft.dim: expected an integer, got 'abc'; nothing was written or submitted"),
    Mistake("sweep", "interval", ["-m", "optim.lr=interval(0,1)", f"run.root={SB}/runs"],
            "optim.lr=interval(0,1): interval() needs a sampling sweeper"),
    Mistake("sweep", "too-many-points", ["-m", "peft.dim=8,16", "optim.lr=1e-3,2e-3", "--max-points=3",
                                         f"run.root={SB}/runs"], "-m: the sweep has 4 points (2 x 2); the limit is 3"),
    Mistake("sweep", "a-point-holds-checkpoints", ["-m", "peft.dim=8,16", f"run.root={SB}/runs", "submit=false",
                                                   "run.name=base"],
            f"point 1 (peft.dim=16): run.name: {SB}/runs/base-dim16 already holds checkpoints (step_3)",
            lambda sb: (sb / "runs" / "base-dim16" / "checkpoints" / "step_3").mkdir(parents=True)),
]


def snapshot(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", CASES, ids=[f"{c.command}-{c.name}" for c in CASES])
def test_a_mistake_is_one_line_exit_2_and_changes_nothing(case: Mistake, sandbox, capsys):
    if case.setup:
        case.setup(sandbox)
    capsys.readouterr()
    before = snapshot(sandbox)
    rc = MAINS[case.command]([a.replace(SB, str(sandbox)) for a in case.argv])
    out, err = capsys.readouterr()
    message = case.message.replace(SB, str(sandbox))
    assert (rc, out) == (2, ""), err
    assert len(err.splitlines()) == 1 and err.startswith("error: " + message), err
    assert snapshot(sandbox) == before


def test_every_command_has_cases():
    assert {c.command for c in CASES} == set(MAINS)


@pytest.mark.parametrize("module,argv", [
    ("launcher.export", ["--checkpoint", "{sandbox}/ck/step_1", "--out", "{sandbox}/adapter"]),
    ("launcher.status", ["--watch", "soon", "{sandbox}"]),
    ("launcher.stop", ["{sandbox}", "--timeout", "-"]),
])
def test_the_entry_points_go_through_the_wrapper(module, argv, sandbox):
    """`python -m ...` as a user types it: the issue's case (export --out an existing file did the
    whole export, then died with a FileExistsError traceback) and one per other command."""
    checkpoint(out="adapter")(sandbox)
    before = snapshot(sandbox)
    p = subprocess.run([sys.executable, "-m", module, *[a.replace(SB, str(sandbox)) for a in argv]],
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith("error: ") and "Traceback" not in p.stderr
    assert snapshot(sandbox) == before
