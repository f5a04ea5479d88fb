"""`launcher.status`, and `launcher.stop` through it, say a local run is RUNNING only while a process
holds the lock on RUN/.in_use (a local run holds it for its whole life: launcher.job.run_dir.hold),
never because the pid in its rendezvous folder's name `local-<pid>.<attempt>` is alive: that pid may
now be any unrelated process. Status tries the lock without creating the file and writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import files, paths, status, stop
from launcher.__main__ import main

PY = sys.executable
NAME = "local-tiny_llama"
HOLDER = """
import sys, time
from pathlib import Path
from launcher.config.compose import compose
from launcher.config.schema import typed
from launcher.job import run_dir
cfg = typed(compose([f"run.root={sys.argv[1]}"]))
run_dir.hold(cfg, Path(sys.argv[1]) / sys.argv[2], keep=True)
print("holding", flush=True)
time.sleep(120)
"""


@pytest.fixture
def run(tmp_path) -> Path:
    """A local run directory as a submission writes it (config.yaml, plan.txt, .in_use: nobody holds it)."""
    assert main(["submit=false", f"run.root={tmp_path}", "grpo.max_num_steps=3"]) == 0
    d = tmp_path / NAME
    assert (d / paths.IN_USE).is_file()
    return d


@pytest.fixture
def process():
    """process(argv) -> a live child process, killed at the end."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str]) -> subprocess.Popen:
        started.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
        return started[-1]

    yield start
    for p in started:
        p.kill()
        p.wait()


def rendezvous_of(run: Path, pid: int) -> str:
    """The rendezvous folder a local run of process `pid` makes (launcher.cluster.context.JobContext.local)."""
    files.make_dir(run / paths.RENDEZVOUS / f"local-{pid}.0")
    return f"local-{pid}"


def snapshot(run: Path) -> dict[str, tuple]:
    return {str(p.relative_to(run)): (p.read_bytes() if p.is_file() else "dir", p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*"))}


def test_a_live_unrelated_process_with_the_runs_pid_is_not_a_running_run(run, process, capsys):
    sleeper = process(["sleep", "60"])  # the pid of an ended run, now reused by something else
    job = rendezvous_of(run, sleeper.pid)
    before = snapshot(run)
    info = status.collect(run)
    assert (info["job_id"], info["state"], info["eta_s"]) == (job, "ENDED", None)
    assert status.main([str(run), "--json"]) == 0
    assert [(i["job_id"], i["state"]) for i in json.loads(capsys.readouterr().out)] == [(job, "ENDED")]
    assert stop.main([str(run)]) == 1  # nothing waited for
    assert capsys.readouterr().err == f"error: {run}: not running (job {job} ENDED); nothing to stop\n"
    assert not (run / "stop_requested").exists()
    assert snapshot(run) == before and sleeper.poll() is None  # status wrote nothing; the process still lives


def test_status_writes_no_lock_file_where_there_is_none(run, process):
    (run / paths.IN_USE).unlink()  # a run directory of a run that never held it
    sleeper = process(["sleep", "60"])
    job = rendezvous_of(run, sleeper.pid)
    before = snapshot(run)
    assert (status.local_job(run)["job_id"], status.local_job(run)["state"]) == (job, "ENDED")
    assert status.in_use(run) is False
    assert snapshot(run) == before and not (run / paths.IN_USE).exists()


def test_the_process_that_holds_the_lock_is_running_until_it_ends(run, process, capsys):
    holder = process([PY, "-c", HOLDER, str(run.parent), NAME])
    assert holder.stdout.readline().strip() == "holding"
    job = rendezvous_of(run, holder.pid)
    assert status.in_use(run) is True
    assert (status.collect(run)["job_id"], status.collect(run)["state"]) == (job, "RUNNING")
    assert status.in_use(run) is True  # status let its own try go at once
    assert stop.main([str(run), "--no-wait"]) == 0, capsys.readouterr().err
    assert json.loads((run / "stop_requested").read_text())["by"] == "python -m launcher.stop"
    holder.kill()
    holder.wait()  # the kernel lets the lock go, however the process ends
    assert (status.collect(run)["state"], status.in_use(run)) == ("ENDED", False)


def test_a_lock_file_that_is_not_a_file_is_one_line_not_a_hang(run, process, capsys):
    (run / paths.IN_USE).unlink()
    os.mkfifo(run / paths.IN_USE)
    rendezvous_of(run, process(["sleep", "60"]).pid)
    assert status.main([str(run)]) == 2
    assert capsys.readouterr().err == f"error: {run}/.in_use: a FIFO, not a regular file: only files are read\n"
