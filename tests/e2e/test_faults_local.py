"""Faults injected into real local runs (`python -m launcher` on this machine): a killed trainer
rank, a killed vLLM engine (with a restart), Ctrl-C, a full disk, and damaged or foreign
checkpoints. Each ends as docs/reliability.md says: a named one-line message, a non-zero exit
within 60 s, no process left behind, no checkpoint lost."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.held_step import HELD_REWARD, release, wait_held

pytestmark = pytest.mark.e2e
PY = sys.executable
QUIET = ["logging.tensorboard=false"]


class Run:
    """`python -m launcher ...` in the background, its output collected line by line."""

    def __init__(self, root: Path, *overrides: str):
        self.root = root
        self.run_dir = root / "local-tiny_llama"
        self.proc = subprocess.Popen([PY, "-m", "launcher", f"run.root={root}", *QUIET, *overrides],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True).start()

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for line in list(self.out):
                m = re.search(pattern, line)
                if m:
                    return m
            assert self.proc.poll() is None, "".join(self.out[-30:] + self.err[-30:])
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} within {timeout}s:\n" + "".join(self.out[-30:]))

    def steps(self) -> list[int]:
        f = self.run_dir / "metrics.jsonl"
        return [json.loads(x)["step"] for x in f.read_text().splitlines()] if f.exists() else []

    def wait_steps(self, n: int, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while len(self.steps()) < n:
            assert self.proc.poll() is None, "".join(self.out[-30:] + self.err[-30:])
            assert time.time() < deadline
            time.sleep(0.05)

    def ended(self) -> str | None:
        """None while the launcher runs, else its output's tail."""
        return None if self.proc.poll() is None else "".join(self.out[-30:] + self.err[-30:])

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise

    def job(self) -> str:
        return next((self.run_dir / "ray").iterdir()).name.split(".")[0]


def test_killed_trainer_rank_ends_the_run_named_within_60s(tmp_path, no_ray_left):
    run = Run(tmp_path, "grpo.max_num_steps=500", "checkpointing.save_period=1000")
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


def test_killed_vllm_engine_restarts_from_checkpoint_and_finishes(tmp_path):
    steps = 6
    run = Run(tmp_path, f"grpo.max_num_steps={steps}", "checkpointing.save_period=2", "retry.max_restarts=1",
              "checkpointing.keep_top_k=null", *HELD_REWARD)
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
    run = Run(tmp_path / "a", "grpo.max_num_steps=500", "checkpointing.save_period=1000")
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

    run2 = Run(tmp_path / "b", "grpo.max_num_steps=500")
    run2.wait_for(r"Ray head up")
    os.killpg(run2.proc.pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(run2.proc.pid, signal.SIGINT)
    rc = run2.finish(timeout=60)
    assert rc == 130
    assert "stopped at once" in "".join(run2.err)
    no_ray_left(run2.job())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-step run with checkpoints step_1 and step_2."""
    root = tmp_path_factory.mktemp("trained")
    p = subprocess.run([PY, "-m", "launcher", f"run.root={root}", *QUIET, "grpo.max_num_steps=2",
                        "checkpointing.save_period=1", "checkpointing.keep_top_k=null"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return root


def resume_error(root: Path, *overrides: str) -> tuple[int, str, dict]:
    run_dir = root / "local-tiny_llama"
    before = {str(p): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    p = subprocess.run([PY, "-m", "launcher", f"run.root={root}", *QUIET, *overrides],
                       capture_output=True, text=True, timeout=120)
    after = {str(p): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing lost
    return p.returncode, p.stderr, before


def copy_of(trained: Path, dest: Path) -> Path:
    shutil.copytree(trained, dest, symlinks=True)
    return dest / "local-tiny_llama" / "checkpoints" / "step_2"


def test_truncated_tensor_file_is_one_clear_error(trained, tmp_path):
    ckpt = copy_of(trained, tmp_path / "r")
    victim = max((ckpt / "trainer").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    rc, err, _ = resume_error(tmp_path / "r", "+resume=step_2")
    assert rc == 2
    assert err.startswith(f"error: resume: {victim}: ") and "(truncated?)" in err and err.count("\n") == 1
    assert "complete checkpoints in" in err


def test_garbage_metadata_is_refused_before_it_is_unpickled(trained, tmp_path):
    ckpt = copy_of(trained, tmp_path / "r")
    meta = ckpt / "trainer" / ".metadata"
    size = meta.stat().st_size
    meta.write_bytes(b"cos\nsystem\n(S'touch /tmp/pwned'\ntR." .ljust(size, b"."))  # same size, a malicious pickle
    rc, err, _ = resume_error(tmp_path / "r", "+resume=latest")
    assert rc == 2
    assert err == (f"error: resume: {meta}: content differs from the manifest (modified or replaced after the save)"
                   f"; complete checkpoints in {ckpt.parent}: step_1\n")


def test_resume_from_another_models_checkpoint_or_a_model_dir(trained, tmp_path):
    ckpt = trained / "local-tiny_llama" / "checkpoints" / "step_2"
    copy_of(trained, tmp_path / "r")
    rc, err, _ = resume_error(tmp_path / "r", "model=tiny_qwen2", "run.name=local-tiny_llama", f"+resume={ckpt}")
    assert rc == 2
    assert err == (f"error: resume: {ckpt} was written for model.family=llama (tiny_llama), this run has qwen2 "
                   f"(tiny_qwen2): not resumable\n")
    model_dir = trained / "models" / "tiny_llama"
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
