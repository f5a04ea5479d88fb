"""Published checkpoints scaled down (tests/helpers/published_models.py: their config.json files as
published, only depth and width edited; RUN_THROUGH: Llama-3.2-1B with its llama3 rope scaling,
Qwen2.5-0.5B-Instruct and Qwen3-30B-A3B with the YaRN their cards advise, Nemotron-H-56B-Base-8K as
transformers 4 saved it, `"time_step_limit": [0.0, Infinity]` and all), each through the whole pipeline
with `model.path` alone: the default `model` group (tiny_llama) and the default topology (trainer TP2,
one vLLM engine), two GRPO steps, a checkpoint.

Per family, one run and what it left:
- the run is named after the checkpoint directory and its config.yaml holds the checkpoint's facts
  (the only numbers the trainer, refit, vLLM and the exporter read);
- refit into vLLM every step: `gen_kl_error` < 1e-5 (float32);
- Megatron against HF transformers on the base model: logprobs within 1e-5, from a trainer built
  (at TP1) from the run's own config.yaml;
- the step-2 checkpoint loaded into that trainer (saved at TP2), exported with
  `launcher.export`, attached with PEFT: PEFT's logprobs equal the trainer's within 1e-5 and
  differ from the base model's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import published_models
from tests.helpers.hf_reference import token_logprobs
from tests.helpers.runs import launch as launch_run

pytestmark = pytest.mark.e2e
PY = sys.executable
ATOL = 1e-5


# A reward that differs between the responses of a group whatever the random model says (the demo's
# say_number can be 0 for all of them, and then nothing is learnt): the adapters must move for the
# export to be tested.
VARIED = """
import zlib

def varied(response, example):
    return (zlib.crc32(response.encode()) % 5) / 4
"""


def launch(model: Path, root: Path) -> subprocess.CompletedProcess:
    reward = root.parent / "varied.py"
    reward.write_text(VARIED)
    return launch_run(root, f"model.path={model}", "grpo.max_num_steps=2", "checkpointing.save_period=2",
                      "logging.tensorboard=false", f"reward.fn={reward}:varied")


def without_rope_scaling(model: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model))
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    return AutoModelForCausalLM.from_pretrained(str(model), config=config, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", published_models.RUN_THROUGH)
def test_published_shape_through_the_pipeline_refit_and_export(name, model_cache, local_ray, tmp_path):
    from omegaconf import OmegaConf
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from launcher.config import model_facts
    from launcher.export import export
    from workers.trainer.config import TrainerConfig
    from workers.trainer.group import TrainerGroup

    model = published_models.build(name, model_cache / "published")
    launch(model, tmp_path / "runs")
    run = tmp_path / "runs" / f"local-{name}"  # named after the checkpoint, not the default group's tiny_llama
    saved = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=True)
    assert model_facts.of_section(saved["model"]) == model_facts.read(model)[0]
    assert saved["model"]["builtin"] is None and saved["model"]["name"] == name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/gen_kl_error"] < ATOL for r in rows) and rows[0]["train/grad_norm"] > 0, rows

    saved["topology"]["train"].update(tensor_parallel=1, ranks_per_node=1, sequence_parallel=False)
    group = TrainerGroup(TrainerConfig.from_run_config(saved, str(model)), num_ranks=1)
    try:
        ids = torch.randint(4, 250, (3, 24), generator=torch.Generator().manual_seed(5))
        base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        base_logprobs = token_logprobs(base, ids)
        assert (group.logprobs({"input_ids": ids}) - base_logprobs).abs().max() < ATOL
        if saved["model"]["rope_scaling"]:  # the agreement includes the scaling: without it, HF differs
            assert (token_logprobs(without_rope_scaling(model), ids) - base_logprobs).abs().max() > 1e-3
        group.load_state(run / "checkpoints" / "step_2" / "trainer")
        trained = group.logprobs({"input_ids": ids})
    finally:
        group.shutdown()
    report = export(run / "checkpoints" / "step_2", tmp_path / "adapter")
    peft = token_logprobs(PeftModel.from_pretrained(base, str(report.out)).eval(), ids)
    assert (peft - trained).abs().max() < ATOL
    assert (peft - base_logprobs).abs().max() > 1e-4  # the adapter changed the model
