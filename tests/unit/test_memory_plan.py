"""The memory plan (launcher.memory, launcher.activations): per GPU, what a trainer rank and a vLLM
worker hold, from the model's facts and size and the topology; a plan that cannot fit is refused in
one line naming what to change.

Every term is checked against a hand computation from Nemotron 3 Ultra's published numbers
(tests/helpers/nemotron3_ultra.py; conf/model/nemotron3_ultra.yaml states them for a dry run):
108 layers = 48 Mamba-2 + 48 MoE + 12 attention, hidden 8192, 64 heads of 128 over 2 KV heads, 512
experts of 5120 (relu2: up and down), top-22, latent 2048, a shared expert of 10240, Mamba 256 heads
of 64, 8 groups, state 128, vocabulary 131072, one MTP step (attention + MoE), bf16. The reference
topology: train TP 2 (sequence parallel) x EP 16 x DP 8, micro-batch 1 of 4096 tokens, selective
recompute; vLLM TP 8. The model numbers of a checkpoint on this machine come from its safetensors
headers and are checked against the HF model itself."""

from __future__ import annotations

import pytest

from launcher import memory, plan as plan_mod
from launcher.__main__ import main
from launcher.config.compose import compose
from launcher.config.schema import typed
from launcher.config.validate import validate
from tests.helpers import nemotron3_ultra

GIB = 2**30
H, LATENT, EXPERT, SHARED, TOPK, EXPERTS, VOCAB = 8192, 2048, 5120, 10240, 22, 512, 131072
INNER, MAMBA_HEADS, GROUPS, STATE = 256 * 64, 256, 8, 128
TOKENS, TP = 4096, 2
# the MTP step the plan leaves out (neither the trainer nor vLLM loads it): attention + MoE + [emb; hidden] -> h
MTP_ATTENTION = H * (64 + 2 * 2) * 128 + 64 * 128 * H + H
MTP_EXPERTS = EXPERTS * 2 * LATENT * EXPERT
MTP_MOE = MTP_EXPERTS + 2 * H * SHARED + 2 * H * LATENT + EXPERTS * H + EXPERTS + H
MTP = MTP_ATTENTION + MTP_MOE + 2 * H * H + 3 * H
PARAMETERS, EXPERT_PARAMETERS = 561e9 - MTP, 524e9 - MTP_EXPERTS   # model.size's, less the MTP step
DENSE = PARAMETERS - EXPERT_PARAMETERS


def plan_of(*overrides):
    cfg = typed(compose(list(overrides)))
    return cfg, memory.plan_memory(cfg, plan_mod.build(cfg.topology))


def line(lines, start):
    return next(x.gib for x in lines if x.what.startswith(start))


def term(m, start):
    return next(t.bytes for t in m.activations.terms if t.what.startswith(start))


def test_the_mtp_step_is_estimated_from_the_facts():
    cfg = typed(compose(["topology=ultra_6n4g"]))
    assert memory.mtp_parameters(cfg.model) == (MTP, MTP_EXPERTS)
    assert 11.2e9 < MTP < 11.3e9   # 561e9 - 549.3e9 (tests/helpers/nemotron3_ultra.py)


def test_the_reference_recipe_fits_and_every_trainer_term_is_the_hand_computed_one():
    cfg, m = plan_of("topology=ultra_6n4g")
    assert m.errors == [] and validate(cfg) == []
    assert line(m.trainer, "weights") == pytest.approx((DENSE / TP + EXPERT_PARAMETERS / 16) * 2 / GIB)
    # LoRA r 16 on linear_qkv (h -> (64 + 2 x 2) x 128) and linear_proj (64 x 128 -> h) of the 12 attention
    # layers, over TP 2: the upstream run's "trainable 3,194,880"
    lora = 12 * 16 * ((H + 64 * 128 + 2 * 2 * 128) + (64 * 128 + H)) // TP
    assert lora == 3_194_880
    assert line(m.trainer, "grads") == pytest.approx(lora * 4 / GIB)
    assert line(m.trainer, "Adam / DP 8") == pytest.approx(12 * lora / 8 / GIB)      # bf16: fp32 master + 2 moments
    assert line(m.trainer, "refit") == pytest.approx(2 * 256 * 2**20 / GIB)
    assert line(m.trainer, "CUDA + NCCL") == 3.0
    # activations, per trainer rank: 4096 tokens, bf16, divided by TP 2 (sequence parallel)
    per_rank = TOKENS * 2 / TP
    assert term(m, "layer inputs and norms") == (48 * 2 + 12 * 2 + 48 * 1) * H * per_rank  # MoE: norm recomputed
    assert term(m, "Mamba") == 48 * (2 * INNER + 2 * GROUPS * STATE + MAMBA_HEADS + 2 * INNER) * per_rank
    assert term(m, "attention") == 12 * (2 * 64 + 2 * 2) * 128 * per_rank     # Q, K, V, context; fused: no scores
    assert term(m, "final norm") == 2 * H * per_rank
    assert term(m, "logits") == TOKENS * VOCAB / TP * (2 + 4 + 4)              # bf16 output, two fp32 copies
    moe_layer = 2 * H / 2 + 2 * EXPERTS * 4 / 2 + TOPK * LATENT + TOPK * (2 * EXPERT + LATENT) + 2 * LATENT \
        + 2 * SHARED   # per token in bf16 units: norm, router (fp32), dispatch, experts, latent projections, shared
    assert term(m, "one layer rebuilt") == pytest.approx(moe_layer * per_rank)
    assert [t.what.split(" (")[0] for t in m.activations.terms] == [
        "layer inputs and norms", "Mamba", "attention", "final norm", "logits", "one layer rebuilt in the backward"]
    assert line(m.trainer, "activations") == pytest.approx(sum(t.bytes for t in m.activations.terms) / GIB)
    text = m.describe()
    assert text.startswith("memory per GPU (184 GiB, topology.gpu_memory_gib; model: model.size)")
    assert "activations per micro-batch of 1 x 4096 tokens (recompute selective)" in text
    assert "DOES NOT FIT" not in text


def test_without_recompute_every_moe_term_is_counted():
    _, m = plan_of("topology=ultra_6n4g", "topology.train.recompute=none", "topology.gpu_memory_gib=300")
    per_rank = TOKENS * 2 / TP
    assert term(m, "layer inputs and norms") == 108 * 2 * H * per_rank
    assert term(m, "router") == 48 * 2 * EXPERTS * 4 * TOKENS / TP                      # fp32
    assert term(m, "MoE dispatch") == 48 * TOPK * LATENT * per_rank                       # k copies of the latent
    assert term(m, "experts") == 48 * TOPK * (EXPERT + EXPERT + LATENT) * per_rank       # fc1, activation, fc2
    assert term(m, "latent projections") == 48 * 2 * LATENT * per_rank
    assert term(m, "shared expert") == 48 * 2 * SHARED * per_rank
    assert not [t for t in m.activations.terms if t.what.startswith("one layer rebuilt")]
    assert m.errors == []


def test_full_recompute_keeps_each_layers_input_and_rebuilds_the_largest():
    _, m = plan_of("topology=ultra_6n4g", "topology.train.recompute=full")
    per_rank = TOKENS * 2 / TP
    assert term(m, "layer inputs") == 108 * H * per_rank
    moe_layer = 2 * H + 2 * EXPERTS * 4 / 2 + TOPK * LATENT + TOPK * (2 * EXPERT + LATENT) + 2 * LATENT + 2 * SHARED
    assert term(m, "one layer rebuilt") == pytest.approx(moe_layer * per_rank)


def test_an_mlp_layer_and_local_attention_keep_their_own_terms():
    """tiny_nemotron_h (M*EM*-: hidden 128, 4 heads of 48 over 2, an MLP of 256, no latent) as if on cuda at TP 2:
    megatron's local attention keeps the probabilities (heads x sequence per token) unless core_attn is recomputed."""
    overrides = ["topology=ultra_6n4g", "model=tiny_nemotron_h", "model.dtype=float32",
                 "topology.train.recompute=none", "topology.train.attention_backend=local",
                 "grpo.max_total_sequence_length=64", "vllm.max_model_len=64"]
    _, m = plan_of(*overrides)
    tokens, per_rank = 64 * 1, 64 * 4 / TP    # float32
    assert term(m, "MLP") == 1 * 2 * 256 * per_rank                                    # relu2: fc1 out, activation
    assert term(m, "attention probabilities") == 2 * 4 * 64 * per_rank
    assert term(m, "attention") == 2 * (2 * 4 + 2 * 2) * 48 * per_rank
    assert term(m, "experts") == 1 * 2 * (64 + 64 + 128) * per_rank                    # no latent: hidden-wide
    assert term(m, "logits") == tokens * 512 / TP * (4 + 8)
    _, m = plan_of(*overrides[:-3], "topology.train.recompute=selective", *overrides[-2:])
    assert not [t for t in m.activations.terms if t.what.startswith(("MLP", "attention probabilities", "experts"))]


def test_every_vllm_term_is_the_hand_computed_one_kv_counts_k_and_v():
    _, m = plan_of("topology=ultra_6n4g")
    assert line(m.engine, "weights (TP 8)") == pytest.approx(PARAMETERS * 2 / 8 / GIB)
    assert line(m.engine, "activations") == memory.ENGINE_ACTIVATIONS_GIB
    # K and V of 12 attention layers, 2 KV heads replicated to 1 per worker at TP 8, head 128, bf16, 4096 tokens
    assert line(m.engine, "KV of one max_model_len sequence") == 2 * 12 * 1 * 128 * 2 * 4096 / GIB
    # 48 Mamba layers: conv state (kernel 4 - 1) x (inner / 8 + 2 x 1 group x 128) in bf16, SSM 32 x 64 x 128 fp32
    assert line(m.engine, "Mamba state") == 48 * (3 * (INNER / 8 + 2 * 1 * STATE) * 2 + 32 * 64 * STATE * 4) / GIB
    assert m.budget_gib == pytest.approx(0.8 * 184)
    assert line(m.engine_outside, "refit buckets") == 2 * 256 * 2**20 / GIB
    # a merged refit: one MoE layer's experts (the pattern's 48 MoE layers share the experts)
    assert line(m.engine_outside, "merged refit") == pytest.approx(EXPERT_PARAMETERS / 48 * 2 / GIB)
    assert line(m.engine_outside, "refit group") == memory.REFIT_GROUP_GIB
    _, m = plan_of("topology=ultra_6n4g", "refit=merged_delta")
    qkv = H * (64 + 2 * 2) * 128
    assert line(m.engine_outside, "merged_delta") == pytest.approx(2 * qkv * 2 / GIB)
    assert "merged_delta keeps the targeted modules' base weights in host memory: " \
           f"{(qkv + 64 * 128 * H) * 12 * 2 * 4 / GIB:.1f} GiB per generation node (4 vLLM workers)" in m.notes


def test_a_step_whose_sequences_overflow_the_kv_cache_is_noted():
    _, m = plan_of("topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.72")
    kv = 2 * 12 * 1 * 128 * 2 * 4096 / GIB + line(m.engine, "Mamba state")
    left = 0.72 * 184 - sum(x.gib for x in m.engine)
    assert 0 < left < 16 * kv and m.errors == []
    assert m.notes == [f"the KV cache ({left:.1f} GiB) holds less than a step's 16 sequences of 4096 tokens per "
                       f"engine ({16 * kv:.1f} GiB): vLLM queues them"]


def test_activations_that_do_not_fit_name_the_first_change_that_makes_them():
    """The reference recipe as it stood (micro_batch_size 0: the rank's 2 sequences at once, no recompute) is
    refused; the line names what fits."""
    cfg, m = plan_of("topology=ultra_6n4g", "topology.train.micro_batch_size=0", "topology.train.recompute=none")
    assert [e.key for e in m.errors] == ["topology.train.recompute"]
    msg = str(m.errors[0])
    assert msg.startswith("topology.train.recompute: a trainer rank needs 97.3 GiB (weights")
    assert "+ activations 170.3 GiB for 2 x 4096 tokens at recompute none (+25% margin) on a 184 GiB GPU" in msg
    assert msg.endswith("set topology.train.recompute=selective (activations 44.7 GiB)")
    assert [str(e) for e in validate(cfg)] == [msg]
    _, m = plan_of("topology=ultra_6n4g", "topology.train.micro_batch_size=0", "topology.train.recompute=none",
                   "topology.gpu_memory_gib=210")
    assert [str(e).rsplit(": ", 1)[-1] for e in m.errors] == [
        "set topology.train.micro_batch_size=1 (activations 85.1 GiB)"]
    _, m = plan_of("topology=ultra_6n4g", "topology.gpu_memory_gib=104")
    assert str(m.errors[0]).startswith("topology.train.tensor_parallel: a trainer rank needs 97.3 GiB")
    assert str(m.errors[0]).endswith("more than fits with micro_batch_size 1 and recompute full: raise "
                                     "topology.train.tensor_parallel or pipeline_parallel")


def test_vllm_at_the_old_default_share_is_refused_naming_the_key():
    cfg, m = plan_of("topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.6")
    assert [e.key for e in m.errors] == ["vllm.gpu_memory_utilization"]
    msg = str(m.errors[0])
    assert msg.startswith("vllm.gpu_memory_utilization: 0.6 x 184 GiB = 110.4 GiB cannot hold weights (TP 8) 128.0")
    assert msg.endswith("set it to at least 0.72 (at most 0.88: refit needs 20.9 GiB outside it)")
    assert [str(e) for e in validate(cfg)] == [msg]


def test_too_large_a_share_leaves_no_room_for_a_merged_refit():
    _, m = plan_of("topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.95")
    assert [str(e) for e in m.errors] == [
        "vllm.gpu_memory_utilization: 0.95 leaves 9.2 GiB outside vLLM's budget, refit needs 20.9 (refit buckets "
        "0.5 + merged refit: one module's weights held by vLLM's layerwise reload 19.9 + refit group 0.5): set it "
        "to at most 0.88"]
    _, m = plan_of("topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.95", "refit=adapter")
    assert m.errors == []  # an adapter refit loads no weights into vLLM


def test_a_gpu_too_small_for_the_engine_and_a_full_fine_tune_too_large_for_the_trainers():
    _, m = plan_of("topology=ultra_6n4g", "topology.gpu_memory_gib=80")  # an H100
    assert [e.key for e in m.errors] == ["topology.train.tensor_parallel", "topology.generation.tensor_parallel"]
    assert str(m.errors[1]).endswith("on a 80 GiB GPU (topology.gpu_memory_gib) at TP 8: raise "
                                     "topology.generation.tensor_parallel")
    _, m = plan_of("topology=ultra_6n4g", "peft=none", "refit=merged")  # every weight trains: grads + Adam
    assert [e.key for e in m.errors] == ["topology.train.tensor_parallel"]
    assert line(m.trainer, "grads") == pytest.approx((DENSE / TP + EXPERT_PARAMETERS / 16) * 4 / GIB)


def test_cpu_has_no_gpu_plan_and_an_unknown_size_is_said():
    cfg, m = plan_of()
    assert m.describe() == "memory: no GPU plan on cpu" and m.errors == []
    _, m = plan_of("topology=ultra_6n4g", "model.size.parameters=null")
    assert m.errors == [] and m.describe().startswith("memory: no plan: model.path /models/nvidia/nemotron-3-ultra "
                                                      "is not on this machine")
    _, m = plan_of("topology=ultra_6n4g", "model.size.vocab_size=null")
    assert "the logits are not counted in the activations (the vocabulary is not known: set model.size.vocab_size)" \
        in m.notes


def test_the_cli_refuses_before_anything_is_written(tmp_path, capsys):
    rc = main(["topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.6", f"run.root={tmp_path}", "dry_run=true"])
    err = capsys.readouterr().err
    assert rc == 2 and "vllm.gpu_memory_utilization: 0.6 x 184 GiB" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
    assert main(["topology=ultra_6n4g", f"run.root={tmp_path}", "dry_run=true"]) == 0
    assert "vLLM worker: budget 147.2 GiB (vllm.gpu_memory_utilization)" in capsys.readouterr().out


def test_the_dry_run_of_nemotron_3_ultras_config_json_fits_and_140_gib_gpus_are_refused(tmp_path, capsys):
    """model.path = a directory holding Ultra's published config.json (the weights stay on the cluster): the facts
    are the file's, the parameter counts model.size's; the plan prints the activation estimate, and the same on
    140 GiB GPUs is refused in one line naming what to change."""
    ultra = nemotron3_ultra.write(tmp_path / "models" / "NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16")
    runs = tmp_path / "runs"
    assert main(["topology=ultra_6n4g", f"model.path={ultra}", f"run.root={runs}", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert " says " not in out   # no note: the conf states the facts config.json has
    assert "activations per micro-batch of 1 x 4096 tokens (recompute selective): layer inputs and norms (108 " \
           "layers) 5.2 + Mamba (48 layers) 12.4 + attention (12 layers) 0.8" in out
    assert "DOES NOT FIT" not in out and f"facts_from: {ultra}/config.json" in out
    _, from_conf = plan_of("topology=ultra_6n4g")
    cfg, from_file = plan_of("topology=ultra_6n4g", f"model.path={ultra}")
    assert from_file.activations == from_conf.activations and from_file.trainer == from_conf.trainer
    assert main(["topology=ultra_6n4g", f"model.path={ultra}", f"run.root={runs}", "dry_run=true",
                 "topology.gpu_memory_gib=140"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: topology.generation.tensor_parallel: a vLLM worker "
                                                         "needs 153.0 GiB")
    assert err.endswith("on a 140 GiB GPU (topology.gpu_memory_gib) at TP 8: raise "
                        "topology.generation.tensor_parallel")
    assert not runs.exists()


def test_a_checkpoint_here_is_read_from_its_headers(tiny_model):
    """Parameter counts against the HF model itself (what this module did not compute)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("tiny_qwen3_moe")
    cfg = typed(compose([f"model.path={path}", "model=tiny_qwen3_moe"]))
    size = memory.model_size(cfg)
    hf = AutoModelForCausalLM.from_pretrained(str(path))
    params = dict(hf.named_parameters())
    assert size.parameters == sum(p.numel() for p in params.values())
    experts = {n: p.numel() for n, p in params.items() if ".experts." in n}
    assert size.expert_parameters == sum(experts.values()) > 0
    per_layer = {}
    for n, k in experts.items():
        layer = n.split(".layers.")[1].split(".")[0]
        per_layer[layer] = per_layer.get(layer, 0) + k
    assert size.largest_module_parameters == max(max(per_layer.values()), hf.get_input_embeddings().weight.numel())
    assert (size.attention_layers, size.kv_heads, size.head_dim) == (2, 2, 32)
    assert size.vocab_size == hf.get_input_embeddings().weight.shape[0] and size.mtp_parameters == 0
    assert size.source.endswith("(safetensors headers)")
