"""MegatronTrainer / TrainerGroup on real Megatron-Bridge LoRA over local Ray (CPU, gloo, float32).

Groups are module-scoped (model start-up is the slow part) and the tests run in file order:
TP=1 (one actor) and TP=2 (two actors) train side by side from the same start, then a
data-parallel group (DP=2) replaces the TP=2 one. Tolerances are float32: 1e-5.
"""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch

from tests.helpers import hf_reference as hf
from tests.helpers.batches import padded_batch
from tests.helpers.hf_reference import assert_close, token_logprobs


pytestmark = pytest.mark.integration

PEFT = {"enabled": True, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "dim": 8,
        "alpha": 16, "dropout": 0.0, "dropout_position": "post", "lora_A_init_method": "xavier",
        "lora_B_init_method": "zero", "lora_dtype": None, "freeze_moe_router": False}
# adam_eps: Adam's first steps move a weight by about lr * g / (|g| + eps), whose slope at g = 0 is
# lr / eps: with the default 1e-8, float32 reduction noise of 1e-10 in a near-zero gradient (TP=2
# sums partial products in another order than TP=1) moved a weight by up to 1e-4 after two steps.
# At 1e-4 the same noise moves it by ~1e-8, so TP=1 and TP=2 are compared to float32's 1e-5.
OPTIM = {"optimizer": "adam", "lr": 5e-3, "min_lr": 5e-3, "clip_grad": 1.0, "lr_decay_style": "constant",
         "adam_eps": 1e-4}
LOSS = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "ratio_clip_c": 10.0, "reference_policy_kl_penalty": 0.01,
        "truncated_importance_sampling_ratio": 5.0, "token_level_loss": True}
ATOL = 1e-5


def make_config(model_dir, tp=1, peft=PEFT, micro_batch_size=0):
    from workers.trainer.config import TrainerConfig

    return TrainerConfig.from_sections(str(model_dir), parallel={"tensor_parallel": tp, "micro_batch_size": micro_batch_size},
                                       peft=peft, optim=OPTIM, loss=LOSS, seed=11, max_num_steps=20)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("tiny_llama")


@pytest.fixture(scope="module")
def batch():
    """4 right-padded sequences of 14 tokens; prompts of 4-6 tokens, responses of different lengths."""
    return padded_batch(14, [(4, 14), (5, 9), (6, 12), (4, 7)])


def with_logprobs(group, batch):
    """The driver's step: previous, generation (slightly off-policy) and reference logprobs."""
    b = dict(batch)
    b["prev_logprobs"] = group.logprobs(batch)
    noise = 0.05 * torch.randn(b["prev_logprobs"].shape, generator=torch.Generator().manual_seed(5))
    b["generation_logprobs"] = (b["prev_logprobs"] + noise) * (batch["loss_mask"] > 0)
    b["reference_logprobs"] = group.logprobs(batch, adapters=False)
    return b


@pytest.fixture(scope="module")
def groups(local_ray, model_dir, tmp_path_factory):
    from tests.helpers.trainer import ProbedTrainerGroup

    tp1 = ProbedTrainerGroup(make_config(model_dir, tp=1), num_ranks=1)
    tp2 = ProbedTrainerGroup(make_config(model_dir, tp=2, micro_batch_size=2), num_ranks=2)
    start = tmp_path_factory.mktemp("start") / "step0"
    tp1.save_state(start)  # lets later groups begin from exactly the same adapters
    yield {"tp1": tp1, "tp2": tp2, "start": start}
    for g in (tp1, tp2):
        g.shutdown()


# --------------------------------------------------------------------------- start-up


def test_peft_statistics_printed_by_rank0(groups):
    tp1, tp2 = groups["tp1"], groups["tp2"]
    # LoRA dim 8 on qkv (128->256), proj (128->128), fc1 (128->512), fc2 (256->128), 2 layers
    per_layer = 8 * (128 + 256) + 8 * (128 + 128) + 8 * (128 + 512) + 8 * (256 + 128)
    assert tp1.infos[0]["num_parameters"]["trainable"] == 2 * per_layer
    assert tp2.infos[0]["num_parameters"]["trainable"] == per_layer  # rank 0's TP half
    pattern = (r"PEFT Statistics:\n  Total parameters: (\d{1,3}(,\d{3})+)\n  Trainable parameters: "
               r"(\d{1,3}(,\d{3})+)\n  Trainable percentage: (\d+\.\d\d)%")
    m = re.fullmatch(pattern, tp1.peft_statistics)
    assert m, tp1.peft_statistics
    total, trainable = (int(m.group(i).replace(",", "")) for i in (1, 3))
    assert trainable == 2 * per_layer and float(m.group(5)) == pytest.approx(100 * trainable / total, abs=0.005)
    # printed to the actor's stdout (Ray writes it to the session's worker-*.out) by rank 0 only
    import ray

    logs = ray._private.worker._global_node.get_logs_dir_path()
    printed = {}
    for rank, where in enumerate(tp2.where):
        files = glob.glob(os.path.join(logs, f"worker-*-{where['pid']}.out"))
        printed[rank] = any("PEFT Statistics:" in open(f).read() for f in files)
    assert printed == {0: True, 1: False}


def test_initial_logprobs_match_hf(groups, model_dir, batch):
    ref = token_logprobs(hf.load(model_dir), batch["input_ids"])
    for name in ("tp1", "tp2"):
        lp = groups[name].logprobs(batch)
        assert lp.dtype == torch.float32 and lp.shape == batch["input_ids"].shape
        assert torch.all(lp[:, 0] == 0)
        assert_close(lp, ref, f"{name} logprobs vs HF")  # lora_B starts at zero
        assert_close(groups[name].logprobs(batch, adapters=False), ref, f"{name} reference vs HF")


# --------------------------------------------------------------------------- training


def test_train_changes_only_adapters_and_tp_agrees(groups, batch):
    tp1, tp2 = groups["tp1"], groups["tp2"]
    before = {name: g.call("parameters_snapshot") for name, g in (("tp1", tp1), ("tp2", tp2))}
    metrics = {}
    for name, g in (("tp1", tp1), ("tp2", tp2)):
        for _ in range(2):
            metrics[name] = g.train(with_logprobs(g, batch))
    for name, g in (("tp1", tp1), ("tp2", tp2)):
        after = g.call("parameters_snapshot")
        for rank, (old, new) in enumerate(zip(before[name], after)):
            changed = {n for n in old if not torch.equal(old[n], new[n])}
            adapters = {n for n in old if ".adapter." in n}
            assert changed == adapters, f"{name} rank {rank}: changed {sorted(changed ^ adapters)[:4]}"
    m1, m2 = metrics["tp1"], metrics["tp2"]
    assert m1["step"] == m2["step"] == 2 and m1["lr"] == m2["lr"] == pytest.approx(5e-3)
    assert m1["grad_norm"] > 0 and m1["kl"] > 0 and m1["is_weight_mean"] != 1.0
    for key in ("loss", "grad_norm", "clip_fraction_low", "clip_fraction_high", "kl", "is_weight_mean"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=ATOL), key
    # The gathered factors agree to float32's reduction order (OPTIM's adam_eps keeps Adam from
    # amplifying it where a gradient is near zero). Logprobs of identical weights are compared to
    # 1e-5 in test_checkpoint_saved_at_tp2_loads_at_tp1.
    a1, a2 = tp1.adapter_state(), tp2.adapter_state()
    assert sorted(a1) == sorted(a2) and len(a1) == 16
    for n in a1:
        assert a1[n].shape == a2[n].shape
        assert_close(a1[n], a2[n], n)
    assert a1["decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight"].abs().max() > 0
    assert_close(tp1.logprobs(batch), tp2.logprobs(batch), "TP=2 vs TP=1 logprobs after training", atol=1e-4)


def test_reference_policy_is_the_pretrained_model(groups, model_dir, batch):
    ref = token_logprobs(hf.load(model_dir), batch["input_ids"])
    for name in ("tp1", "tp2"):
        g = groups[name]
        assert (g.logprobs(batch) - ref).abs().max() > 1e-3  # the adapters do change the policy
        assert_close(g.logprobs(batch, adapters=False), ref, f"{name} adapters off vs pretrained HF")


def test_merged_export_reproduces_trainer_logprobs(groups, model_dir, batch):
    for name in ("tp1", "tp2"):
        g = groups[name]
        exported = g.export_merged()
        names = [n for n, _ in exported]
        assert len(names) == len(set(names)) and "lm_head.weight" in names
        assert not [n for n in names if ".base_layer" in n or ".adapter" in n or ".lora_" in n]
        assert_close(token_logprobs(hf.load(model_dir, exported), batch["input_ids"]), g.logprobs(batch),
                     f"{name}: HF with merged export vs trainer")


def test_refit_guard_raises_on_unmerged_names(groups):
    from workers.refit.wire import guard_names as guard_refit_names
    from workers.trainer.group import TrainerGroupError

    t = torch.zeros(1)
    assert list(guard_refit_names([("model.layers.0.mlp.up_proj.weight", t)]))
    for bad in ("model.layers.0.self_attn.q_proj.base_layer.weight", "x.lora_A.weight", "x.adapter.linear_in"):
        with pytest.raises(RuntimeError, match=re.escape(bad)):
            list(guard_refit_names([("ok.weight", t), (bad, t)]))
    # the real path: Megatron-Bridge without merging names wrapped bases `...base_layer...`
    with pytest.raises(TrainerGroupError, match=r"refit guard.*\.base_layer"):
        groups["tp1"].call("export_unmerged_state", keep="rank0")


# --------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_same_layout(groups, batch, tmp_path):
    tp1 = groups["tp1"]
    tp1.save_state(tmp_path / "ckpt")
    saved_adapters, saved_optimizer = tp1.adapter_state(), tp1.optimizer_state()
    b = with_logprobs(tp1, batch)
    first = tp1.train(b)
    after_first = tp1.adapter_state()
    info = tp1.load_state(tmp_path / "ckpt")
    assert info["rng_restored"] and info["step"] == first["step"] - 1
    loaded_adapters, loaded_optimizer = tp1.adapter_state(), tp1.optimizer_state()
    assert all(torch.equal(saved_adapters[n], loaded_adapters[n]) for n in saved_adapters)
    assert sorted(saved_optimizer) == sorted(loaded_optimizer)
    for n, state in saved_optimizer.items():
        assert set(state) >= {"exp_avg", "exp_avg_sq"}
        assert all(torch.equal(state[k], loaded_optimizer[n][k]) for k in state), n
    second = tp1.train(b)
    for key in ("loss", "grad_norm", "lr", "step", "clip_fraction_low", "clip_fraction_high"):
        assert first[key] == second[key], key
    again = tp1.adapter_state()
    assert all(torch.equal(after_first[n], again[n]) for n in after_first)


def test_checkpoint_saved_at_tp2_loads_at_tp1(groups, batch, tmp_path):
    tp1, tp2 = groups["tp1"], groups["tp2"]
    tp2.save_state(tmp_path / "tp2")
    saved_adapters, saved_optimizer = tp2.adapter_state(), tp2.optimizer_state()
    info = tp1.load_state(tmp_path / "tp2")
    assert info["saved_layout"]["tensor_parallel"] == 2 and not info["rng_restored"]
    loaded_adapters, loaded_optimizer = tp1.adapter_state(), tp1.optimizer_state()
    assert sorted(saved_adapters) == sorted(loaded_adapters)
    assert all(torch.equal(saved_adapters[n], loaded_adapters[n]) for n in saved_adapters)
    for n, state in saved_optimizer.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[k], loaded_optimizer[n][k]), (n, k)
        assert float(state["step"]) == float(loaded_optimizer[n]["step"])
    assert_close(tp1.logprobs(batch), tp2.logprobs(batch), "TP=1 with TP=2's weights")
    b = with_logprobs(tp2, batch)
    m2, m1 = tp2.train(b), tp1.train(b)
    assert m1["step"] == m2["step"] and m1["lr"] == m2["lr"]
    for key in ("loss", "grad_norm", "clip_fraction_low", "clip_fraction_high", "kl"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=ATOL), key
    a1, a2 = tp1.adapter_state(), tp2.adapter_state()
    for n in a1:
        assert_close(a1[n], a2[n], f"next step {n}", atol=1e-4)  # one Adam step from equal states


# --------------------------------------------------------------------------- data parallel


@pytest.fixture(scope="module")
def dp2(groups, model_dir):
    from tests.helpers.trainer import ProbedTrainerGroup

    groups["tp2"].shutdown()  # free the two train slots
    group = ProbedTrainerGroup(make_config(model_dir, tp=1), num_ranks=2)
    yield group
    group.shutdown()


def test_data_parallel_split_equals_one_rank(groups, dp2, batch):
    tp1 = groups["tp1"]
    assert [i["dp_rank"] for i in dp2.infos] == [0, 1]
    for g in (tp1, dp2):
        g.load_state(groups["start"])
    assert_close(dp2.logprobs(batch), tp1.logprobs(batch), "DP=2 gathered logprobs")
    for _ in range(2):
        b = with_logprobs(tp1, batch)
        m1, m2 = tp1.train(b), dp2.train(b)
        # sequences have different numbers of trained tokens: the token-level mean must be global
        for key in ("loss", "grad_norm", "kl", "is_weight_mean", "num_tokens"):
            assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=ATOL), key
    a1, a2 = tp1.adapter_state(), dp2.adapter_state()
    for n in a1:
        assert_close(a1[n], a2[n], f"DP=2 vs DP=1 {n}", atol=1e-4)  # Adam, see the TP test
    per_rank = dp2.call("adapter_state")
    assert all(torch.equal(per_rank[0][n], per_rank[1][n]) for n in per_rank[0])  # replicas stay equal


def test_full_finetuning_trains_every_weight(local_ray, model_dir, batch):
    from tests.helpers.trainer import ProbedTrainerGroup

    group = ProbedTrainerGroup(make_config(model_dir, tp=1, peft={**PEFT, "enabled": False, "target_modules": []}),
                               num_ranks=1)
    try:
        assert group.infos[0]["num_parameters"]["trainable"] == group.infos[0]["num_parameters"]["total"]
        with pytest.raises(Exception, match="adapters=False"):
            group.logprobs(batch, adapters=False)
        before = group.call("parameters_snapshot")[0]
        b = dict(batch, prev_logprobs=group.logprobs(batch))
        group.train(b)
        after = group.call("parameters_snapshot")[0]
        assert all(not torch.equal(before[n], after[n]) for n in ("decoder.layers.0.self_attention.linear_qkv.weight",
                                                                     "output_layer.weight"))
        exported = group.export_merged()
        assert group.adapter_state() == {}
        assert_close(token_logprobs(hf.load(model_dir, exported), batch["input_ids"]), group.logprobs(batch),
                     "full FT export")
    finally:
        group.shutdown()


def test_dead_actor_is_named(dp2, batch):
    import ray
    from workers.trainer.group import TrainerGroupError

    ray.kill(dp2.actors[1])
    where = dp2.where[1]
    with pytest.raises(TrainerGroupError, match=rf"trainer rank 1 \(node {re.escape(where['node_ip'])}.*died"):
        dp2.logprobs(batch)
