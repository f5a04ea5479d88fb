"""benchmarks/agreement.py in its CI form: the tiny model, two training steps, bf16, every refit
mode, with the real trainer and vLLM engines (its own local Ray, in a subprocess). It checks the
benchmark still runs end to end and that what it reports is agreement, not noise: no timings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from tests.conftest import REPO


def test_bf16_agreement_benchmark_runs_on_the_tiny_model_for_two_steps(tmp_path, model_cache):
    out = tmp_path / "agreement"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "agreement.py"), "--tiny", "--steps", "2",
                           "--dtypes", "bf16", "--out", str(out), "--cache", str(model_cache)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "agreement.json").read_text())
    assert (out / "agreement.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted({(r["mode"], r["step"]) for r in rows}) == sorted(
        (m, s) for m in ("merged", "merged_delta", "adapter") for s in (0, 1, 2))
    assert {r["dtype"] for r in rows} == {"bf16"}
    for r in rows:
        assert math.isfinite(r["gen_kl_error"]) and 0.0 <= r["gen_kl_error"] < 1e-2, r
        assert 1.0 <= r["token_mult_prob_error"] < 1.1, r
    by = {(r["mode"], r["step"]): r for r in rows}
    # B starts at zero: before training every mode serves the base weights, and the same engine
    # (merged and merged_delta share one) samples and scores the same tokens
    assert by[("merged", 0)]["delta_over_w"] == 0.0 and by[("merged", 0)]["policy_moved"] < 1e-6
    assert by[("merged", 0)]["gen_kl_error"] == by[("merged_delta", 0)]["gen_kl_error"]
    assert 0.0 < by[("merged", 1)]["delta_over_w"] < by[("merged", 2)]["delta_over_w"] < 0.0039  # small deltas
    assert "| bf16 | adapter |" in proc.stdout
