"""The one restart policy (launcher.cluster.restarts), which a local run and a Slurm job both follow:
each failure is a line of RUN/failures.jsonl, counted per job; retry.max_restarts of them restart."""

from __future__ import annotations

import json

from launcher.cluster import restarts
from launcher.config.schema import Config, Retry


def test_each_failure_is_recorded_and_max_restarts_of_them_restart_per_job(tmp_path):
    cfg = Config(retry=Retry(max_restarts=2))
    got = [restarts.after_failure(cfg, tmp_path, "7", RuntimeError(f"node {i} left")) for i in range(3)]
    assert got == [1, 2, None]
    # another job of the same run directory (a new submission) counts its own
    assert restarts.after_failure(cfg, tmp_path, "8", RuntimeError("engine died")) == 1
    rows = [json.loads(line) for line in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert [(r["job"], r["error"]) for r in rows] == [("7", "node 0 left"), ("7", "node 1 left"),
                                                       ("7", "node 2 left"), ("8", "engine died")]
    assert restarts.restart_line(cfg, 2) == "restart 2/2 (retry.max_restarts)"
    assert restarts.after_failure(Config(retry=Retry(max_restarts=0)), tmp_path, "9", RuntimeError("x")) is None


def test_a_restart_without_a_complete_checkpoint_resumes_from_the_runs_own_resume(tmp_path):
    cfg = Config()
    assert restarts.resume_after_requeue(cfg, tmp_path) is None   # from the beginning
    cfg.resume = "/runs/a/checkpoints/step_3"
    assert restarts.resume_after_requeue(cfg, tmp_path) == "/runs/a/checkpoints/step_3"
