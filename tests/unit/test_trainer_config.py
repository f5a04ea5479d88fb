"""TrainerConfig takes the project's config sections as they are; the DP batch split is exact."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from launcher.config.compose import compose

from workers.refit.wire import guard_names as guard_refit_names
from workers.trainer.config import TrainerConfig
from workers.trainer.group import split_batch

CONF = Path(__file__).resolve().parents[2] / "conf"


def section(path: str) -> dict:
    """The section of the preset conf/<group>/<name>.yaml as a run gets it: composed over the
    schema's defaults (a preset states only what it changes)."""
    group, name = path.removesuffix(".yaml").split("/")
    return copy.deepcopy(_composed(f"{group}={name}")[group])


@functools.lru_cache(maxsize=None)
def _composed(override: str) -> dict:
    return OmegaConf.to_container(compose([override]))


@pytest.mark.parametrize("peft", sorted(p.name for p in (CONF / "peft").glob("*.yaml")))
@pytest.mark.parametrize("topology", ["local.yaml", "slurm_3n.yaml", "ultra_6n4g.yaml"])
def test_every_peft_and_topology_section_is_accepted(peft, topology):
    topo = section(f"topology/{topology}")
    train = topo["train"]  # composed: ultra_6n4g's ${topology.gpus_per_node} resolved
    cfg = TrainerConfig.from_sections(
        "/models/x", parallel=train, peft=section(f"peft/{peft}"), optim=section("optim/adam_constant.yaml"),
        loss=section("grpo/demo.yaml")["loss"], device=topo["device"], seed=1, max_num_steps=12)
    assert cfg.peft.enabled == section(f"peft/{peft}")["enabled"]
    assert cfg.parallel.tensor_parallel == topo["train"]["tensor_parallel"]
    # optim.use_distributed_optimizer: auto = distributed on cuda only (megatron refuses CPU tensors)
    assert cfg.use_distributed_optimizer == (topo["device"] == "cuda")


def test_from_run_config():
    run = {"topology": section("topology/local.yaml"), "peft": section("peft/lora_attention.yaml"),
           "optim": section("optim/adam_constant.yaml"), "grpo": section("grpo/demo.yaml"),
           "model": section("model/tiny_llama.yaml"), "run": {"seed": 1234}}
    run["topology"]["train"]["micro_batch_size"] = 2
    cfg = TrainerConfig.from_run_config(run, "/tmp/model")
    assert (cfg.seed, cfg.max_num_steps, cfg.device, cfg.dtype, cfg.parallel.micro_batch_size) == (
        1234, run["grpo"]["max_num_steps"], "cpu", "float32", 2)
    assert cfg.parallel.tensor_parallel == 2 and cfg.peft.target_modules == ["linear_qkv", "linear_proj"]
    assert cfg.loss.ratio_clip_c == 10.0 and cfg.optim.lr == 1e-5


@pytest.mark.parametrize("bad, message", [
    ({"peft": {"enabled": True, "target_modules": []}}, "target_modules"),
    ({"peft": {"lora_rank": 8}}, r"peft: unknown keys \['lora_rank'\]"),
    ({"optim": {"optimizer": "muon"}}, "adam or sgd"),
    ({"parallel": {"tensor_parallel": 1, "sequence_parallel": True}}, "sequence_parallel: needs train.tensor_parallel > 1"),
    ({"parallel": {"context_parallel": 2}}, "context_parallel"),
    ({"loss": {"ratio_clip_c": 0.5}}, "ratio_clip_c"),
])
def test_bad_sections_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig.from_sections("/m", **bad)


def test_split_batch_is_contiguous_and_complete():
    batch = {"input_ids": torch.arange(5)[:, None].repeat(1, 3), "advantages": torch.arange(5.0), "note": "x"}
    parts = split_batch(batch, 2)
    assert [p["advantages"].tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0, 4.0]]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])
    assert parts[1]["note"] == "x"
    with pytest.raises(ValueError, match="cannot be split"):
        split_batch(batch, 6)


def test_refit_guard_names_the_offending_weight():
    t = torch.zeros(1)
    assert [n for n, _ in guard_refit_names([("model.norm.weight", t)])] == ["model.norm.weight"]
    with pytest.raises(RuntimeError, match=r"'model.layers.0.mlp.down_proj.base_layer.weight'.*'.base_layer'"):
        list(guard_refit_names([("model.layers.0.mlp.down_proj.base_layer.weight", t)]))


def test_every_trainer_knob_is_reachable_from_a_run():
    """What a run's config sets is what the trainer gets, as the driver builds it (grpo.start):
    the micro-batch size from topology.train, and no TrainerConfig field a run cannot set."""
    import dataclasses

    from omegaconf import OmegaConf

    from launcher.config import compose
    from launcher.config.schema import typed

    cfg = typed(compose.compose(["topology.train.micro_batch_size=3", "run.seed=7", "grpo.temperature=0.7",
                                 "topology.generation.mamba_ssm_cache_dtype=bfloat16"]))
    plain = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    trainer = TrainerConfig.from_run_config(plain, "/tmp/model")
    assert (trainer.parallel.micro_batch_size, trainer.seed, trainer.temperature) == (3, 7, 0.7)
    assert trainer.generation_ssm_cache_dtype == "bfloat16"  # auto Mamba training states follow it
    assert trainer.model == plain["model"] and trainer.facts.family == "llama"   # the run's resolved facts
    set_by_run = {"model_path", "device", "dtype", "seed", "max_num_steps", "temperature", "parallel", "peft", "optim",
                  "loss", "model", "generation_ssm_cache_dtype"}
    assert {f.name for f in dataclasses.fields(TrainerConfig)} == set_by_run
