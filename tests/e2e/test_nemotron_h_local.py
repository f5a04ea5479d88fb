"""The reference model's family end to end on this machine, as a user runs it.

`python -m launcher model=tiny_nemotron3` (Nemotron 3 as released: Mamba-2 + attention + LatentMoE
with a shared expert, MTP layers in the checkpoint; the local topology trains it at TP2 with sequence
parallelism, merged refit into vLLM CPU every step) learns in the default run length. And Nemotron 3
Super given by `model.path` alone, its published config.json scaled down in depth and width
(tests/helpers/published_models.py: LatentMoE, one MTP step "*E", every other key as published), whose
layer pattern, heads, Mamba sizes, experts and latent width differ from the recipe's, trains at TP2 x EP2
with exact refits: its numbers come from its config.json.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.e2e
PY = sys.executable


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tiny_nemotron3_learns_in_the_default_run(tmp_path):
    p = subprocess.run([PY, "-m", "launcher", "model=tiny_nemotron3", f"run.root={tmp_path}", "run.name=nh",
                        "logging.tensorboard=false"], capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    r = rows(tmp_path / "nh")
    assert [x["step"] for x in r] == list(range(1, 41))  # the default run length (conf/grpo/demo.yaml)
    assert all(x["train/gen_kl_error"] < 1e-5 for x in r), [x["train/gen_kl_error"] for x in r]
    first, last = (sum(x["train/reward"] for x in part) / len(part) for part in (r[:5], r[-5:]))
    assert last > first + 0.15, (first, last)  # measured: 0.04 -> 0.40
    assert "TP 2" in (tmp_path / "nh" / "plan.txt").read_text()
    facts = yaml.safe_load((tmp_path / "nh" / "config.yaml").read_text())["model"]["family_facts"]
    assert (facts["moe_latent_size"], facts["num_nextn_predict_layers"]) == (32, 1)


def test_nemotron_3_super_as_published_by_model_path_alone(model_cache, tmp_path):
    from tests.helpers import published_models

    name = "NVIDIA-Nemotron-3-Super-120B-A12B-BF16"
    model = published_models.build(name, model_cache / "published")
    p = subprocess.run([PY, "-m", "launcher", f"model.path={model}", "topology.train.expert_parallel=2",
                        "grpo.max_num_steps=2", f"run.root={tmp_path}", "run.name=super", "logging.tensorboard=false"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    run = tmp_path / "super"
    # the model section came from its config.json (the default model group is tiny_llama), once
    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert (saved["family"], saved["num_layers"], saved["num_experts"], saved["moe_router_topk"]) == (
        "nemotron_h", 9, 8, 3)
    facts = saved["family_facts"]
    assert (facts["hybrid_override_pattern"], facts["moe_latent_size"], facts["num_nextn_predict_layers"],
            facts["mtp_hybrid_override_pattern"]) == ("MEMEMEM*E", 16, 1, "*E") and saved["builtin"] is None
    assert saved["facts_from"] == f"{model}/config.json" and saved["name"] == name
    r = rows(run)
    assert [x["step"] for x in r] == [1, 2]
    # step 1 on the weights the engines loaded (model.path: the trainers' W_0), later steps refit
    assert all(x["train/gen_kl_error"] < 1e-5 and (x["refit/bytes"] > 0) == (x["step"] > 1) for x in r), r
    assert "EP 2" in (run / "plan.txt").read_text()
    assert (run / "checkpoints" / "step_2").is_dir()
