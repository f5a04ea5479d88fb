"""Faults injected into real local runs (`python -m launcher` on this machine): a killed trainer
rank, a killed vLLM engine (with a restart), Ctrl-C, a full disk, and damaged or foreign
checkpoints. Each ends as docs/reliability.md says: a named one-line message, a non-zero exit
within 60 s, no process left behind, no checkpoint lost."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.held_step import HELD_REWARD, release, wait_held
from tests.helpers.runs import Background, left_in_tmp

pytestmark = pytest.mark.e2e
PY = sys.executable
QUIET = ["logging.tensorboard=false"]


def test_killed_trainer_rank_ends_the_run_named_within_60s(tmp_path, no_ray_left):
    run = Background(tmp_path, *QUIET, "grpo.max_num_steps=500", "checkpointing.save_period=1000")
    pid = int(run.wait_for(r"trainer rank 1: \S+-pid(\d+)\.log").group(1))
    run.wait_steps(2)
    os.kill(pid, signal.SIGKILL)
    rc = run.finish(timeout=60)  # the bound: a dead rank ends the run within 60 s, never a hang
    err = "".join(run.err)
    assert rc == 1, err
    m = re.search(r"error: trainer rank 1 on \S+ \(pid (\d+)\) died during (\w+) at step (\d+): ", err)
    assert m, err
    assert int(m.group(1)) == pid and m.group(2) in ("refit", "generation", "logprobs", "training")
    assert "Traceback" not in err
    no_ray_left(run.job())
    assert left_in_tmp(run.job()) == []  # and its Ray temp dir is gone


def test_killed_vllm_engine_restarts_from_checkpoint_and_finishes(tmp_path):
    steps = 6
    run = Background(tmp_path, *QUIET, f"grpo.max_num_steps={steps}", "checkpointing.save_period=2",
                     "retry.max_restarts=1", "checkpointing.keep_top_k=null", *HELD_REWARD)
    pid = int(run.wait_for(r"vLLM engine 0: \S+-pid(\d+)\.log").group(1))
    wait_held(run.run_dir, run.ended, timeout=300)
    os.kill(pid, signal.SIGKILL)  # in step 3 (held_step.HELD_STEP)
    release(run.run_dir)
    rc = run.finish(timeout=400)
    out, err = "".join(run.out), "".join(run.err)
    assert rc == 0, out[-3000:] + err[-3000:]
    m = re.search(r"error: vLLM engine 0 on \S+ \(pid (\d+)\) died during (\w+) at step (\d+)", err)
    assert m and int(m.group(1)) == pid, err
    assert re.search(r"restart 1/1 \(retry.max_restarts\) from \S+/checkpoints/step_\d+", out), out[-3000:]
    assert run.steps() == list(range(1, steps + 1))  # every step once: the lost ones were redone
    assert f"finished at step {steps}/{steps}" in out
    assert json.loads(next(iter((run.run_dir / "failures.jsonl").read_text().splitlines())))["error"].startswith(
        "vLLM engine 0 on")


def test_ctrl_c_saves_a_checkpoint_then_stops_and_a_second_stops_at_once(tmp_path, no_ray_left):
    run = Background(tmp_path / "a", *QUIET, "grpo.max_num_steps=500", "checkpointing.save_period=1000")
    run.wait_steps(2)
    os.killpg(run.proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
    rc = run.finish(timeout=120)
    out = "".join(run.out)
    assert rc == 130, out[-2000:] + "".join(run.err)[-2000:]
    assert "Ctrl-C: stopping after the current step and saving a checkpoint" in out
    k = int(re.search(r"stopped at step (\d+)/500", out).group(1))
    assert (run.run_dir / "checkpoints" / f"step_{k}" / "manifest.json").is_file()
    assert "+resume=latest" in "".join(run.err)
    no_ray_left(run.job())
    assert left_in_tmp(run.job()) == []  # and its Ray temp dir is gone

    # the second Ctrl-C while a step still runs (its rewards held): a person's, a second or more after
    # the first (one sooner is the first delivered again, launcher.cluster.stop); one Ctrl-C during the
    # start-up already ends the run before step 1, with nothing to save (tests/unit/test_ctrl_c.py)
    run2 = Background(tmp_path / "b", *QUIET, "grpo.max_num_steps=500", *HELD_REWARD)
    wait_held(run2.run_dir, run2.ended, timeout=300)
    os.killpg(run2.proc.pid, signal.SIGINT)
    time.sleep(1.5)
    os.killpg(run2.proc.pid, signal.SIGINT)
    rc = run2.finish(timeout=60)
    release(run2.run_dir)  # the reward worker's held call ends (it is in a session of its own)
    assert rc == 130
    assert "stopped at once" in "".join(run2.err)
    assert not list((run2.run_dir / "checkpoints").glob("step_*"))
    no_ray_left(run2.job())
    assert left_in_tmp(run2.job()) == []


def resume_error(root: Path, *overrides: str) -> tuple[int, str, dict]:
    run_dir = root / "local-tiny_llama"
    before = {str(p): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    p = subprocess.run([PY, "-m", "launcher", f"run.root={root}", *QUIET, *overrides],
                       capture_output=True, text=True, timeout=120)
    after = {str(p): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing lost
    return p.returncode, p.stderr, before


def copy_of(trained_run, dest: Path) -> Path:
    """The session's trained run as it was after step 2 (checkpoints step_1, step_2), in dest: its step_2."""
    return trained_run.copy(dest, until_step=2) / "checkpoints" / "step_2"


def test_truncated_tensor_file_is_one_clear_error(trained_run, tmp_path):
    ckpt = copy_of(trained_run, tmp_path / "r")
    victim = max((ckpt / "trainer").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    rc, err, _ = resume_error(tmp_path / "r", "+resume=step_2")
    assert rc == 2
    assert err.startswith(f"error: resume: {victim}: ") and "(truncated?)" in err and err.count("\n") == 1
    assert "complete checkpoints in" in err


def test_garbage_metadata_is_refused_before_it_is_unpickled(trained_run, tmp_path):
    ckpt = copy_of(trained_run, tmp_path / "r")
    meta = ckpt / "trainer" / ".metadata"
    size = meta.stat().st_size
    meta.write_bytes(b"cos\nsystem\n(S'touch /tmp/pwned'\ntR." .ljust(size, b"."))  # same size, a malicious pickle
    rc, err, _ = resume_error(tmp_path / "r", "+resume=latest")
    assert rc == 2
    assert err == (f"error: resume: {meta}: content differs from the manifest (modified or replaced after the save)"
                   f"; complete checkpoints in {ckpt.parent}: step_1\n")


def test_resume_from_another_models_checkpoint_or_a_model_dir(trained_run, tmp_path):
    ckpt = trained_run.checkpoint(2)
    copy_of(trained_run, tmp_path / "r")
    rc, err, _ = resume_error(tmp_path / "r", "model=tiny_qwen2", "run.name=local-tiny_llama", f"+resume={ckpt}")
    assert rc == 2
    assert err == (f"error: resume: {ckpt} was written for model.family=llama (tiny_llama), this run has qwen2 "
                   f"(tiny_qwen2): not resumable\n")
    model_dir = trained_run.root / "models" / "tiny_llama"
    rc, err, _ = resume_error(tmp_path / "r", f"+resume={model_dir}")
    assert rc == 2
    assert err.startswith(f"error: resume: {model_dir}: incomplete checkpoint (no manifest.json); complete "
                          f"checkpoints in ")


def test_full_disk_is_refused_before_writing_a_checkpoint(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        p = subprocess.run([PY, "-m", "launcher", f"run.root={tmp_path}", *QUIET, "grpo.max_num_steps=2",
                            f"checkpointing.dir={mnt}"], capture_output=True, text=True, timeout=600)
        assert p.returncode == 1, p.stdout[-2000:]
        assert re.search(r"error: checkpoint step_2 needs about [\d.]+ MiB but only 0\.\d MiB are free in "
                         + re.escape(str(mnt)) + r"; nothing was written", p.stderr), p.stderr
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)])
