"""benchmarks/agreement.py in its CI form: the tiny model, two training steps, bf16, every refit
mode, with the real trainer and vLLM engines. It checks the benchmark still runs end to end and
that what it reports is agreement, not noise: no timings. It runs in the integration tier's Ray
(its own local Ray when run by hand): the start-up of Ray and of a Python process is paid once."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration


# Hang detection, not a time claim: its 190 s of CPU (four engines and a trainer) took 1070 s of wall
# at CI's load of 40, past the suite's 900 s per test.
@pytest.mark.timeout(1800)
def test_bf16_agreement_benchmark_runs_on_the_tiny_model_for_two_steps(local_ray, tmp_path, model_cache, capsys):
    spec = importlib.util.spec_from_file_location("agreement_benchmark", REPO / "benchmarks" / "agreement.py")
    agreement = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agreement)
    out = tmp_path / "agreement"
    agreement.main(["--tiny", "--steps", "2", "--dtypes", "bf16", "--out", str(out), "--cache", str(model_cache)])
    stdout = capsys.readouterr().out
    assert local_ray.is_initialized()  # the suite's Ray, not shut down by the benchmark
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
    assert "| bf16 | adapter |" in stdout
