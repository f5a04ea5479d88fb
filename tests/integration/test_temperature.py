"""Sampling at temperature T != 1: the logprobs the loss uses are those of the distribution the
tokens were sampled from, log_softmax(logits / T), on both sides: the trainer divides its logits
by grpo.temperature, and vLLM reports processed logprobs (after temperature). Before, vLLM
reported raw logprobs and the trainer applied no temperature: the two agreed with each other
(gen_kl_error ~ 0) while both described the T=1 policy, not the one that sampled."""

from __future__ import annotations

import pytest
import torch

from launcher.driver.agreement import agreement_metrics
from launcher.driver.rollout import Rollout, build_batch
from tests.helpers import hf_reference as hf
from tests.helpers.hf_reference import token_logprobs

pytestmark = pytest.mark.integration

T = 0.7
PEFT = {"enabled": True, "target_modules": ["linear_qkv", "linear_proj"], "dim": 8, "alpha": 16, "dropout": 0.0,
        "dropout_position": "post", "lora_A_init_method": "xavier", "lora_B_init_method": "zero", "lora_dtype": None,
        "freeze_moe_router": False}
OPTIM = {"optimizer": "adam", "lr": 5e-3, "min_lr": 5e-3, "clip_grad": 1.0, "lr_decay_style": "constant"}
LOSS = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "ratio_clip_c": 10.0, "reference_policy_kl_penalty": 0.0,
        "truncated_importance_sampling_ratio": 5.0, "token_level_loss": True}
SLOT = {"resources": {"generation_slot": 1}, "num_cpus": 1}


@pytest.fixture(scope="module")
def sampled(local_ray, tiny_model):
    from workers.generator.actor import GeneratorConfig
    from workers.generator.group import GeneratorGroup
    from workers.trainer.config import TrainerConfig
    from workers.trainer.group import TrainerGroup

    model_dir = tiny_model("tiny_llama")
    gens = GeneratorGroup(GeneratorConfig(model=str(model_dir), kv_cache_memory_bytes=32 * 2**20,
                                          logprobs_mode="processed_logprobs"), [SLOT], ready_timeout_s=300)
    trainers = TrainerGroup(TrainerConfig.from_sections(str(model_dir), parallel={"tensor_parallel": 1}, peft=PEFT,
                                                        optim=OPTIM, loss=LOSS, seed=11, max_num_steps=5,
                                                        temperature=T), num_ranks=1)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(4, 250, (n,), generator=g).tolist() for n in (3, 5, 8, 4, 6, 7)]
        outs = gens.generate(prompts, temperature=T, max_tokens=12, seeds=list(range(1, 7)))
        rollout = Rollout(prompts, [o.token_ids for o in outs], [o.logprobs for o in outs], [0.0] * len(prompts))
        batch = build_batch(rollout, [0.0] * len(prompts), 0)
        batch["prev_logprobs"] = trainers.logprobs(batch)
        yield model_dir, batch
    finally:
        gens.shutdown()
        trainers.shutdown()


def test_trainer_logprobs_are_log_softmax_of_logits_over_temperature(sampled):
    model_dir, batch = sampled
    ref = token_logprobs(hf.load(model_dir), batch["input_ids"], T)
    mask = batch["loss_mask"] > 0
    err = (batch["prev_logprobs"] - ref).abs()[mask].max().item()
    assert err < 1e-5, err
    untempered = token_logprobs(hf.load(model_dir), batch["input_ids"], 1.0)
    assert (untempered - ref).abs()[mask].max().item() > 1e-2  # what T=1 logprobs would have been: far off


def test_vllm_reports_the_same_tempered_logprobs(sampled):
    model_dir, batch = sampled
    ref = token_logprobs(hf.load(model_dir), batch["input_ids"], T)
    mask = batch["loss_mask"] > 0
    assert (batch["generation_logprobs"] - ref).abs()[mask].max().item() < 1e-4  # vLLM CPU kernels vs torch
    m = agreement_metrics(batch["generation_logprobs"], batch["prev_logprobs"], batch["loss_mask"])
    assert m["gen_kl_error"] < 1e-5 and abs(m["token_mult_prob_error"] - 1.0) < 1e-4
