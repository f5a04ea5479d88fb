"""Every command the launcher prints for a person to paste is pasted here, into bash, harmlessly.

The run root of each case is a folder whose name holds what a shell would act on: a space, quotes,
`$(...)`, backquotes and `;`. Each printed command is run by bash as pasted, with every program it
could name (tail, python, scancel, sbatch, vllm, ray, touch) replaced by a shell function that
records its arguments; the test requires exactly the calls the command means (the right programs,
the paths as one word each) and no other: a substitution or a second command would be a call too.
The commands are built by launcher/shell.py; names read from files pass the run-name rule first
(a forged run.name in a checkpoint: tests/unit/test_export_errors.py).
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from launcher import __main__ as cli
from tests.helpers import run_lock

SUBMIT = cli._submit   # the real one: the sandbox fixture replaces it with a sentinel
HOSTILE = "it's a $(touch PWNED) `touch PWNED`; touch PWNED & x"
PROGRAMS = ("tail", "python", "scancel", "sbatch", "vllm", "ray", "touch")


def paste(command: str, tmp: Path) -> list[list[str]]:
    """`command` run by bash as pasted (in `tmp`), its programs recorded: the argv of each call."""
    rec = tmp / "calls"
    rec.mkdir(exist_ok=True)
    recorder = "".join(
        f"{name}() {{ n=$((n+1)); printf '%s\\0' {name} "
        + ('"env:RAY_AUTH_MODE=$RAY_AUTH_MODE" "env:RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH" '
           if name == "ray" else "")
        + f'"$@" > {shlex.quote(str(rec))}/$n; }}\n' for name in PROGRAMS)
    p = subprocess.run(["bash", "-c", f"n=0\n{recorder}{command}\n"], cwd=tmp, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    calls = sorted(rec.iterdir(), key=lambda f: int(f.name))
    out = [f.read_text().split("\0")[:-1] for f in calls]
    for f in calls:
        f.unlink()
    assert not list(tmp.rglob("PWNED"))
    return out


def hydra(value: object) -> str:
    """A value as a quoted Hydra override value (the user types it so: key='...')."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def after(text: str, label: str, until: str | None = None) -> str:
    line = next(x for x in text.splitlines() if label in x)
    cmd = line.split(label, 1)[1]
    return cmd.split(until, 1)[0] if until else cmd


@pytest.fixture
def root(sandbox) -> Path:
    r = sandbox / HOSTILE / "runs"
    r.mkdir(parents=True)
    return r


def test_the_submission_lines(sandbox, root, capsys, monkeypatch):
    from launcher.job import slurm_job

    monkeypatch.setattr(cli, "_submit", SUBMIT)
    monkeypatch.setattr(cli, "_submit_job", lambda cfg, plan, run_dir: "4242")
    assert cli.main(["topology=slurm_3n", f"run.root={hydra(root)}", "run.name=r"]) == 0
    out = capsys.readouterr().out
    run = root / "r"
    log, _ = slurm_job.task_logs(run, "4242")
    assert paste(after(out, "follow the driver: "), sandbox) == [["tail", "-F", str(log)]]
    assert paste(after(out, "   status: "), sandbox) == [["python", "-m", "launcher.status", str(run)]]
    assert paste(after(out, "stop after a checkpoint: ", "   cancel now: "), sandbox) == [
        ["python", "-m", "launcher.stop", str(run)]]
    assert paste(after(out, "   cancel now: "), sandbox) == [["scancel", "4242"]]


def test_the_sbatch_line_of_a_run_directory_written_for_plain_sbatch(sandbox, root, capsys):
    assert cli.main(["topology=slurm_3n", f"run.root={hydra(root)}", "run.name=w", "submit=false"]) == 0
    command = capsys.readouterr().out.splitlines()[-1].strip()
    assert paste(command, sandbox) == [["sbatch", str(root / "w" / "ray_job.sbatch")]]


def test_the_lines_of_a_sweep(sandbox, root, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_submit_job", lambda cfg, plan, run_dir: "4242")
    assert cli.main(["-m", "topology=slurm_3n", f"run.root={hydra(root)}", "peft.dim=8,16"]) == 0
    out = capsys.readouterr().out
    (sweep,) = (root / "sweeps").iterdir()
    assert paste(after(out, "follow it: "), sandbox) == [["python", "-m", "launcher.status", str(sweep), "--watch"]]
    assert cli.main(["-m", "topology=slurm_3n", f"run.root={hydra(root)}", "peft.dim=8,16", "submit=false"]) == 0
    lines = capsys.readouterr().out.split("submit each with:\n", 1)[1].splitlines()
    assert [paste(x, sandbox) for x in lines] == [[["sbatch", str(root / f"slurm_3n-tiny_llama-dim{d}" /
                                                                    "ray_job.sbatch")]] for d in (8, 16)]


def test_the_hold_jobs_attach_and_release_lines(sandbox, root):
    from launcher.driver.jobs import hold_hint

    token, release = root / "r" / "ray" / "1.0" / "token", root / "r" / "release"
    attach, end = hold_hint(token, release).removeprefix("attach with: ").split("   end with: ")
    assert paste(attach, sandbox) == [["ray", "env:RAY_AUTH_MODE=token", f"env:RAY_AUTH_TOKEN_PATH={token}", "status"]]
    assert paste(end, sandbox) == [["touch", str(release)]]


def test_the_exporters_serve_line(sandbox, root, tiny_model, capsys):
    from launcher.config import compose as config_mod
    from launcher.config.schema import Checkpointing
    from launcher.driver.checkpoints import CheckpointManager
    from launcher.export import main
    from tests.helpers.checkpoints import trainer_state
    from tests.unit.test_export_errors import R, attention_lora

    base = tiny_model("tiny_llama")
    raw = config_mod.compose([f"model.path={base}", "peft=lora_attention", f"peft.dim={R}", "run.name=served"])
    manager = CheckpointManager(root / "served" / "checkpoints", Checkpointing())
    tmp = manager.begin(1)
    trainer_state(tmp / "trainer", 1, attention_lora())
    ckpt = manager.commit(tmp, 1, {"consumed_prompts": 0, "metrics": {}}, config_mod.to_yaml(raw)).path
    out = sandbox / HOSTILE / "adapter"
    assert main(["--checkpoint", str(ckpt), "--out", str(out)]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1]
    assert paste(command, sandbox) == [["vllm", "serve", str(base), "--enable-lora", "--lora-modules",
                                        f"served-step1={out}", "--max-lora-rank", "8"]]


def test_the_stop_commands_follow_line(sandbox, root, capsys):
    """`launcher.stop --no-wait` names the status command to follow the run with."""
    import os

    from launcher import files, stop

    assert cli.main([f"run.root={hydra(root)}", "run.name=l", "submit=false"]) == 0
    run = root / "l"
    files.make_dir(run / "ray" / f"local-{os.getpid()}.0")  # a local run whose process (this one) lives
    capsys.readouterr()
    with run_lock.held(run):  # and holds its run directory
        assert stop.main([str(run), "--no-wait"]) == 0, capsys.readouterr().err
    assert paste(after(capsys.readouterr().out, "follow it: "), sandbox) == [
        ["python", "-m", "launcher.status", str(run), "--watch"]]


def test_a_hint_that_names_a_value_read_from_a_run_directory(sandbox, root, capsys):
    """A run directory whose config.yaml keeps its checkpoints elsewhere: the refusal's hint names that
    folder (read from the file) as an override to paste. Pasted, it is one word that Hydra reads back
    as the folder itself, whatever the folder's name holds."""
    from launcher.config.compose import compose

    elsewhere = sandbox / HOSTILE / "ckpts"
    assert cli.main(["topology=slurm_3n", f"run.root={hydra(root)}", "run.name=h", "submit=false",
                     f"checkpointing.dir={hydra(elsewhere)}"]) == 0
    (elsewhere / "step_1").mkdir()   # the run has written a checkpoint there
    capsys.readouterr()
    assert cli.main(["topology=slurm_3n", f"run.root={hydra(root)}", "run.name=h", "submit=false"]) == 2
    err = capsys.readouterr().err
    ((program, *words),) = paste("python " + after(err, "continue it with ", ", or start fresh"), sandbox)
    assert (program, words[1:]) == ("python", ["+resume=latest"]), words
    assert compose([words[0]]).checkpointing.dir == str(elsewhere)
