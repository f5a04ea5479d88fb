"""A fresh launch (no +resume) on the run directory of a run that trained steps but saved no
checkpoint is refused in one line naming run.name, before anything in the directory changes
(config.yaml and metrics.jsonl keep their bytes and mtimes): such a launch rewrote config.yaml and
its job dropped every metrics row. +resume cannot continue such a run (it has no checkpoint; the
line says so and names only another run.name). What a submission alone (submit=false), a run stopped
during its start-up or a placement smoke leaves stays reusable; a run with checkpoints is refused
as before and +resume continues it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launcher import files, paths
from launcher.__main__ import main
from launcher.config.schema import Checkpointing, Logging
from launcher.driver import metrics
from launcher.driver.startup import Startup
from launcher.job import run_dir as run_dir_mod

PY = sys.executable
NAME = "local-tiny_llama"
NO_CKPT = ["checkpointing.enabled=false", "grpo.max_num_steps=3"]


def submitted(root: Path, *extra: str) -> Path:
    """What a submission writes (submit=false, the local topology): config.yaml, plan.txt, .in_use, logs/,
    checkpoints/."""
    assert main(["submit=false", f"run.root={root}", *extra]) == 0
    named = [e.split("=", 1)[1] for e in extra if e.startswith("run.name=")]
    return root / (named[-1] if named else "slurm_3n-tiny_llama" if "topology=slurm_3n" in extra else NAME)


def trained(root: Path, steps: int, finished: bool = True, *extra: str) -> Path:
    """A local run that trained `steps` steps, as its job writes the run directory: its rendezvous folder,
    metrics rows (MetricsLogger), startup.json after step 1, and when it finished summary.txt and `done`."""
    run = submitted(root, *(extra or NO_CKPT))
    rendezvous = run / paths.RENDEZVOUS / "local-4242.0"
    files.make_dir(rendezvous)
    logger = metrics.MetricsLogger(run, Logging(tensorboard=False), total_steps=3)
    for step in range(1, steps + 1):
        logger.log(step, {"train/reward": 0.1 * step, "timing/total_step": 2.0})
        if step == 1:
            startup = Startup(time.time() - 5)
            startup.mark("step 1 (this run's first)")
            startup.write(run / paths.STARTUP)
    logger.close()
    if finished:
        files.write(run / paths.SUMMARY, metrics.summary(metrics.read(run / paths.METRICS)) + "\n")
        files.write_json(rendezvous / paths.DONE, {"ok": True, "error": None})
    return run


def snapshot(run: Path) -> dict[str, tuple]:
    """Every path under `run`: its bytes (files) and mtime."""
    return {str(p.relative_to(run)): (p.read_bytes() if p.is_file() else "dir", p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*"))}


def refusal(run: Path, what: str) -> str:
    return (f"error: run.name: {run} holds the results of a run ({what}) but no checkpoint in {run}/checkpoints, "
            f"so +resume cannot continue it; start fresh with run.name=<new name>\n")


def test_a_fresh_launch_over_a_finished_run_without_checkpoints_is_refused_and_changes_nothing(tmp_path, capsys):
    run = trained(tmp_path, steps=3)
    rows = (run / paths.METRICS).read_bytes()
    assert [json.loads(r)["step"] for r in rows.decode().splitlines()] == [1, 2, 3]
    before = snapshot(run)
    capsys.readouterr()
    assert main(["submit=false", f"run.root={tmp_path}", *NO_CKPT]) == 2
    assert capsys.readouterr().err == refusal(run, "3 metrics rows up to step 3, startup.json, summary.txt")
    assert snapshot(run) == before
    assert (run / paths.METRICS).read_bytes() == rows
    # the same with submit=true (the launch that ran the job): refused at the same check, before anything
    assert main([f"run.root={tmp_path}", *NO_CKPT]) == 2
    assert capsys.readouterr().err == refusal(run, "3 metrics rows up to step 3, startup.json, summary.txt")
    assert snapshot(run) == before
    # what the line says: +resume cannot continue it
    assert main(["submit=false", f"run.root={tmp_path}", *NO_CKPT, "+resume=latest"]) == 2
    assert capsys.readouterr().err == f"error: resume: no complete checkpoint in {run}/checkpoints to resume from\n"
    assert snapshot(run) == before
    # and what it says to do works, leaving this run as it is
    assert main(["submit=false", f"run.root={tmp_path}", *NO_CKPT, "run.name=fresh"]) == 0
    assert (tmp_path / "fresh" / paths.CONFIG).is_file()
    assert snapshot(run) == before


def test_a_run_killed_after_two_steps_is_refused_in_one_line_by_the_command(tmp_path):
    run = trained(tmp_path, steps=2, finished=False)
    config = ((run / paths.CONFIG).read_bytes(), (run / paths.CONFIG).stat().st_mtime_ns)
    rows = ((run / paths.METRICS).read_bytes(), (run / paths.METRICS).stat().st_mtime_ns)
    p = subprocess.run([PY, "-m", "launcher", f"run.root={tmp_path}", "submit=false", *NO_CKPT],
                       capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr == refusal(run, "2 metrics rows up to step 2, startup.json")
    assert ((run / paths.CONFIG).read_bytes(), (run / paths.CONFIG).stat().st_mtime_ns) == config
    assert ((run / paths.METRICS).read_bytes(), (run / paths.METRICS).stat().st_mtime_ns) == rows


def test_a_sweep_point_holding_results_is_refused_before_any_point_is_written(tmp_path, capsys):
    run = trained(tmp_path, 1, True, *NO_CKPT, "run.name=base-dim16")
    assert run == tmp_path / "base-dim16"
    assert run_dir_mod.results(run) == ["1 metrics row up to step 1", "startup.json", "summary.txt"]
    before = snapshot(run)
    capsys.readouterr()
    assert main(["-m", "peft.dim=8,16", f"run.root={tmp_path}", "submit=false", "run.name=base", *NO_CKPT]) == 2
    assert capsys.readouterr().err == (
        f"error: point 1 (peft.dim=16): run.name: {run} holds the results of a run (1 metrics row up to step 1, "
        f"startup.json, summary.txt) but no checkpoint in {run}/checkpoints, so +resume cannot continue it; "
        f"start fresh with run.name=<new name>; nothing was written or submitted\n")
    assert not (tmp_path / "base-dim8").exists() and snapshot(run) == before


def test_a_metrics_file_that_cannot_be_read_is_named_not_waited_on(tmp_path, capsys):
    run = submitted(tmp_path, *NO_CKPT)
    os.mkfifo(run / paths.METRICS)  # the job's MetricsLogger would block on it forever
    capsys.readouterr()
    assert main(["submit=false", f"run.root={tmp_path}", *NO_CKPT]) == 2
    assert capsys.readouterr().err == refusal(run, "metrics.jsonl unread: a FIFO, not a regular file: only files "
                                                   "are read")


def test_what_a_submission_alone_wrote_stays_reusable(tmp_path, capsys):
    for extra in ([], ["topology=slurm_3n"]):  # config.yaml, plan.txt (and ray_job.sbatch), .in_use, logs/
        first = submitted(tmp_path, *extra)
        assert (first / paths.SBATCH_SCRIPT).is_file() == bool(extra) and (first / paths.IN_USE).is_file()
        assert run_dir_mod.results(first) == []
        assert main(["submit=false", f"run.root={tmp_path}", *extra, "optim.lr=0.02"]) == 0, capsys.readouterr().err
        assert "lr: 0.02" in (first / paths.CONFIG).read_text()


def test_a_run_that_trained_no_step_stays_reusable(tmp_path, capsys):
    """Stopped during its start-up (its closing line: the same command starts it again from step 1), or
    a placement smoke / preflight (which use the real run's name): the records of a job that ran, an
    empty metrics.jsonl, a summary of no steps, a placement report - nothing a new launch loses."""
    run = submitted(tmp_path, *NO_CKPT)
    rendezvous = run / paths.RENDEZVOUS / "local-4242.0"
    files.make_dir(rendezvous)
    files.write_json(rendezvous / paths.HEAD, {"ip": "127.0.0.1", "port": 6379})
    files.write_json(rendezvous / paths.DONE, {"ok": True, "error": None})
    metrics.MetricsLogger(run, Logging(tensorboard=False), total_steps=3).close()  # created, no row
    files.write(run / paths.SUMMARY, metrics.summary([]) + "\n")
    files.write_json(run / paths.PLACEMENT, {"actors": []})
    assert (run / paths.METRICS).read_text() == "" and run_dir_mod.results(run) == []
    capsys.readouterr()
    assert main(["submit=false", f"run.root={tmp_path}", *NO_CKPT]) == 0, capsys.readouterr().err


def test_a_run_with_checkpoints_is_refused_as_before_and_resume_continues_it(tmp_path, capsys):
    from launcher.driver.checkpoints import CheckpointManager
    from tests.helpers.checkpoints import trainer_state

    run = trained(tmp_path, 3, True, "grpo.max_num_steps=3")
    mgr = CheckpointManager(run / paths.CHECKPOINTS, Checkpointing())
    tmp = mgr.begin(2)
    trainer_state(tmp / "trainer", 2)
    mgr.commit(tmp, 2, {"consumed_prompts": 8, "metrics": {}}, (run / paths.CONFIG).read_text())
    capsys.readouterr()
    assert main(["submit=false", f"run.root={tmp_path}", "grpo.max_num_steps=3"]) == 2
    assert capsys.readouterr().err == (f"error: run.name: {run} already holds checkpoints (step_2); continue it "
                                       f"with +resume=latest, or start fresh with run.name=<new name>\n")
    assert main(["submit=false", f"run.root={tmp_path}", "grpo.max_num_steps=3", "+resume=latest"]) == 0, \
        capsys.readouterr().err
    # the branch from step_2: row 3 moved aside, nothing deleted (launcher.driver.checkpoints.CheckpointManager)
    assert [r["step"] for r in metrics.read(run / paths.METRICS)] == [1, 2]
    (aside,) = (run / paths.ABANDONED).iterdir()
    assert [r["step"] for r in metrics.read(aside / paths.METRICS)] == [3]
