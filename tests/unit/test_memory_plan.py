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
headers and are checked against the HF model itself. What the reference case does not exercise (pipeline
parallelism, TP without sequence parallelism, each attention backend, a CUDA node without Transformer
Engine) is checked on the tiny Nemotron-H recipes (launcher.config.schema.BUILTIN_MODELS), in float32."""

from __future__ import annotations

import pytest

from launcher import activations, memory, plan as plan_mod
from launcher.__main__ import main
from launcher.config.compose import compose
from launcher.config.schema import ATTENTION_BACKENDS, selective_modules, typed
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
# what every TP rank holds whole, in megatron and in vLLM: per MoE layer fc1_latent_proj (h -> latent),
# fc2_latent_proj (latent -> h) and the router (h -> experts); 48 MoE layers
REPLICATED = 48 * (H * LATENT + LATENT * H + H * EXPERTS)
DENSE = PARAMETERS - EXPERT_PARAMETERS - REPLICATED   # split over TP


def plan_of(*overrides):
    cfg = typed(compose(list(overrides)))
    return cfg, memory.plan_memory(cfg, plan_mod.build(cfg.topology))


def line(lines, start):
    return next(x.gib for x in lines if x.what.startswith(start))


def term(m, start):
    return next(t.bytes for t in m.activations.terms if t.what.startswith(start))


def terms(acts) -> dict[str, float]:
    """{term without its layer count: bytes}"""
    return {t.what.split(" (")[0]: t.bytes for t in acts.terms}


# tiny_nemotron_h_dense (M*-M*-: hidden 128, 4 heads of 48 over 2 KV heads, a relu2 MLP of 256, Mamba 8 heads of
# 16 = inner 128, 2 groups, state 16; vocabulary 512) in float32, 64-token sequences, on the reference topology's
# train section (TP 2, 16 ranks) without experts
TINY_DENSE = ["topology=ultra_6n4g", "model=tiny_nemotron_h_dense", "model.dtype=float32",
              "topology.train.expert_parallel=1", "topology.train.recompute=none",
              "grpo.max_total_sequence_length=64", "vllm.max_model_len=64"]
# per token of one layer, in elements: Mamba's in_proj output (2 x 128 + 2 x 2 x 16 + 8), out_x, the gated norm's
# input and out_proj's input (128 each); attention's Q, K, V, context ((2 x 4 + 2 x 2) x 48); relu2 MLP's fc1
# output and activation (2 x 256)
TINY_MAMBA, TINY_ATTENTION, TINY_MLP = 2 * 128 + 2 * 2 * 16 + 8 + 3 * 128, (2 * 4 + 2 * 2) * 48, 2 * 256


def test_the_mtp_step_is_estimated_from_the_facts():
    cfg = typed(compose(["topology=ultra_6n4g"]))
    assert memory.mtp_parameters(cfg.model) == (MTP, MTP_EXPERTS)
    assert 11.2e9 < MTP < 11.3e9   # 561e9 - 549.3e9 (tests/helpers/nemotron3_ultra.py)


def test_the_reference_recipe_fits_and_every_trainer_term_is_the_hand_computed_one():
    cfg, m = plan_of("topology=ultra_6n4g")
    assert m.errors == [] and validate(cfg) == []
    assert line(m.trainer, "weights") == pytest.approx((DENSE / TP + REPLICATED + EXPERT_PARAMETERS / 16) * 2 / GIB)
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
    assert term(m, "Mamba") == 48 * (2 * INNER + 2 * GROUPS * STATE + MAMBA_HEADS + 3 * INNER) * per_rank
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


def test_latent_projections_and_routers_are_whole_on_every_tp_rank():
    """megatron-core's MoELayer builds fc1_latent_proj and fc2_latent_proj as TELinear(parallel_mode="duplicated")
    and its Router.weight as a plain Parameter; vLLM's NemotronHMoE builds them ReplicatedLinear (the router a
    GateLinear): both roles hold them whole on every TP rank, where the plan had divided them by TP."""
    _, m = plan_of("topology=ultra_6n4g")
    # per MoE layer: fc1_latent_proj 8192 x 2048 = 16,777,216, fc2_latent_proj 2048 x 8192 = 16,777,216, the
    # router 512 x 8192 = 4,194,304; 48 MoE layers: 1,811,939,328 weights, 3.375 GiB in bf16
    assert m.size.replicated_parameters == 48 * (16_777_216 + 16_777_216 + 4_194_304) == 1_811_939_328
    whole = 1_811_939_328 * 2 / GIB
    assert whole == 3.375
    # the trainer at TP 2: 3.375 GiB, not 3.375 / 2 (+1.6875 GiB: the latent projections' 1.5 and the routers'
    # 0.1875) on top of every other dense weight over TP and the experts over EP 16
    divided = ((PARAMETERS - EXPERT_PARAMETERS) / 2 + EXPERT_PARAMETERS / 16) * 2 / GIB
    assert line(m.trainer, "weights") - divided == pytest.approx(3.375 - 3.375 / 2)
    assert 3.375 - 3.375 / 2 == 1.6875
    # a vLLM worker at TP 8: 3.375 GiB, not 3.375 / 8 (+2.953 GiB: the latent projections' 2.625 and the
    # routers' 0.328)
    assert line(m.engine, "weights (TP 8)") - PARAMETERS * 2 / 8 / GIB == pytest.approx(3.375 * 7 / 8)
    assert 3.375 * 7 / 8 == 2.953125
    # over pipeline stages they are split like every other layer: PP 2 (TP 2 x PP 2 x DP 4) halves the whole
    _, m = plan_of("topology=ultra_6n4g", "topology.train.pipeline_parallel=2")
    assert line(m.trainer, "weights") == pytest.approx(
        ((PARAMETERS - EXPERT_PARAMETERS - 1_811_939_328) / 4 + 1_811_939_328 / 2 + EXPERT_PARAMETERS / 32) * 2 / GIB)


def test_a_mamba_layer_keeps_its_gated_norms_input():
    """megatron's MambaMixer._ssm_training calls mamba_split_conv1d_scan_combined without the norm's weight (the
    kernel keeps zxBCdt and out_x, the scan's output before the gate, and returns the gated output), then
    self.norm(y): mamba_ssm's RMSNormGated, whose LayerNormFn keeps its input x, the gated output; out_proj keeps
    the norm's output. Three inner-wide tensors after in_proj's output: the plan had counted two."""
    _, m = plan_of("topology=ultra_6n4g")
    # per token of one Mamba layer, in elements: in_proj's output z, x, B, C, dt = 16384 + 16384 + 2 x 8 x 128
    # + 256 = 35,072; out_x 16,384; the norm's input 16,384; out_proj's input 16,384: 84,224
    assert 2 * INNER + 2 * GROUPS * STATE + MAMBA_HEADS == 35_072
    per_token = 35_072 + 16_384 + 16_384 + 16_384
    # 48 layers x 4096 tokens / TP 2 (sequence parallel) x 2 bytes (bf16) = 15.42 GiB
    assert term(m, "Mamba") == 48 * per_token * 4096 // 2 * 2 == 15.421875 * GIB
    # of which the gated norm's input: 48 x 16,384 x 4096 / 2 x 2 bytes = 3 GiB
    assert 48 * 16_384 * 4096 // 2 * 2 == 3 * GIB


def test_a_merged_refit_also_holds_the_layer_vllm_materialises():
    """vLLM's layerwise reload (model_loader/reload/layerwise.py, _layerwise_process) buffers every tensor a layer
    receives; once the layer is complete, materialize_layer allocates the layer's own parameters (its TP shard:
    FusedMoE's w13_weight and w2_weight, experts x moe_intermediate / TP x latent each) and loads the buffered
    tensors into them; both are held until the copy into the kernel's tensors. The plan had counted only the
    buffered tensors."""
    _, m = plan_of("topology=ultra_6n4g")
    # one MoE layer's routed experts: model.size's 524e9 less the MTP step's 512 x 2 x 2048 x 5120, over 48 layers
    layer = (524e9 - 512 * 2 * 2048 * 5120) / 48
    assert 10.69e9 < layer < 10.70e9    # the facts' 512 x (5120 x 2048 + 2048 x 5120) = 10.74e9
    assert line(m.engine_outside, "merged refit") == pytest.approx(layer * 2 / GIB)              # received: 19.9 GiB
    # materialised at TP 8: each expert's up (5120 / 8 x 2048) and down (2048 x 5120 / 8): 1.34e9 weights, 2.49 GiB
    assert line(m.engine_outside, "the layer it materialises (TP 8)") == pytest.approx(layer / 8 * 2 / GIB)
    assert line(m.engine_outside, "the layer it materialises") == pytest.approx(2.4897, abs=1e-4)
    assert sum(x.gib for x in m.engine_outside) == pytest.approx(0.5 + layer * 2 / GIB + layer / 8 * 2 / GIB + 0.5)
    for mode in ("merged_delta", "adapter"):   # neither reloads a MoE layer
        _, m = plan_of("topology=ultra_6n4g", f"refit={mode}")
        assert not [x for x in m.engine_outside if x.what.startswith("the layer")]


def test_tensor_parallel_without_sequence_parallelism_keeps_the_hidden_wide_terms_whole():
    """A dense model at TP 2 without sequence parallelism: every rank holds the whole sequence's hidden-wide
    tensors (layer inputs, norms, the final norm); heads, Mamba's and the MLP's widths are split over TP."""
    _, m = plan_of(*TINY_DENSE, "topology.train.sequence_parallel=false")
    a = m.activations
    assert (a.micro_batch, a.sequence, a.micro_batches, a.tokens) == (1, 64, 2, 64)   # 16 sequences / DP 8 = 2
    per_token = 64 * 4     # 64 tokens x 4 bytes (float32)
    assert terms(a) == {
        "layer inputs and norms": 6 * (128 + 128) * per_token,          # not divided: 393,216
        "Mamba": 2 * TINY_MAMBA * per_token / 2,                        # over TP 2: 182,272
        "attention": 2 * TINY_ATTENTION * per_token / 2,                # 147,456 (fused: no probabilities)
        "MLP": 2 * TINY_MLP * per_token / 2,                            # 131,072
        "final norm": 2 * 128 * per_token,                              # not divided: 65,536
        "logits": 64 * 512 / 2 * (4 + 2 * 4)}                           # the vocabulary over TP: 196,608
    assert terms(a)["layer inputs and norms"] == 393_216 and terms(a)["final norm"] == 65_536
    # with sequence parallelism only those two are halved
    _, sp = plan_of(*TINY_DENSE, "topology.train.sequence_parallel=true")
    assert terms(sp.activations) == {**terms(a), "layer inputs and norms": 393_216 / 2, "final norm": 65_536 / 2}


def test_pipeline_parallel_2_holds_its_half_of_the_layers_for_each_micro_batch_in_flight():
    """PP 2 (TP 2 x PP 2 x DP 4: 16 sequences / 4 = 4 per rank): the first stage holds layers M*- of M*-M*-, and
    under 1F1B as many micro-batches as there are stages (at most the micro-batches there are); the final norm and
    the logits are one micro-batch's (the last stage's)."""
    _, m = plan_of(*TINY_DENSE, "topology.train.pipeline_parallel=2", "topology.train.micro_batch_size=1")
    a = m.activations
    assert (a.micro_batch, a.micro_batches, a.tokens) == (1, 4, 64)   # 4 micro-batches of 1 sequence, 2 in flight
    per_token = 64 * 4 / 2     # 64 tokens x 4 bytes over TP 2 (sequence parallel)
    assert terms(a) == {
        "layer inputs and norms": 2 * 3 * (128 + 128) * per_token,   # 2 micro-batches x 3 layers: 196,608
        "Mamba": 2 * 1 * TINY_MAMBA * per_token,                     # 2 x its one Mamba layer: 182,272
        "attention": 2 * 1 * TINY_ATTENTION * per_token,             # 147,456
        "MLP": 2 * 1 * TINY_MLP * per_token,                         # 131,072
        "final norm": 2 * 128 * per_token,                           # 32,768
        "logits": 64 * 512 / 2 * (4 + 2 * 4)}                        # 196,608
    assert terms(a)["Mamba"] == 182_272
    # one micro-batch of the rank's 4 sequences (256 tokens): the first stage holds it once
    _, m = plan_of(*TINY_DENSE, "topology.train.pipeline_parallel=2", "topology.train.micro_batch_size=4")
    a = m.activations
    assert (a.micro_batch, a.micro_batches, a.tokens) == (4, 1, 256)
    per_token = 256 * 4 / 2
    assert terms(a) == {
        "layer inputs and norms": 3 * (128 + 128) * per_token,       # 393,216
        "Mamba": TINY_MAMBA * per_token,                             # 364,544
        "attention": TINY_ATTENTION * per_token,                     # 294,912
        "MLP": TINY_MLP * per_token,                                 # 262,144
        "final norm": 2 * 128 * per_token,                           # 131,072
        "logits": 256 * 512 / 2 * (4 + 2 * 4)}                       # 786,432
    assert terms(a)["Mamba"] == 364_544


def test_every_attention_backend_and_which_keep_the_probabilities():
    """megatron's local attention (DotProductAttention) and Transformer Engine's unfused one keep the softmax's
    output, heads x sequence per token; flash, fused (cuDNN) and auto (TE's pick of those) keep none; selective
    recompute (core_attn) drops them."""
    # 2 attention layers x 4 heads x 64 (the sequence) x 4 bytes x 64 tokens / TP 2 = 65,536
    probabilities = 2 * 4 * 64 * 4 * 64 / 2
    assert probabilities == 65_536
    expected = {"fused": 0, "flash": 0, "auto": 0, "unfused": probabilities, "local": probabilities}
    assert set(expected) == set(ATTENTION_BACKENDS)
    for backend, kept in expected.items():
        _, m = plan_of(*TINY_DENSE, f"topology.train.attention_backend={backend}")
        got = terms(m.activations)
        assert got.get("attention probabilities", 0) == kept, backend
        assert got["attention"] == 2 * TINY_ATTENTION * 64 * 4 / 2 == 147_456
        _, m = plan_of(*TINY_DENSE, f"topology.train.attention_backend={backend}", "topology.train.recompute=selective")
        assert "attention probabilities" not in terms(m.activations), backend


def test_a_cuda_node_without_transformer_engine_gets_the_local_specs_settings():
    """workers.trainer.provider_settings on a CUDA node without Transformer Engine: the local layer spec (every
    norm a module of its own, so `layernorm` recompute drops the attention's and the MLP's norm output too;
    megatron's MambaLayer recomputes none), megatron's local attention (it keeps the probabilities unless
    core_attn is recomputed), and no moe_act (no grouped GEMM). tiny_nemotron_h: M*EM*- (the tiny dense one's
    layers and a MoE layer: 4 relu2 experts of 64, top-2, a shared expert of 64, no latent), TP 2 (sequence
    parallel: MoE), EP 1."""
    from workers.trainer import kernels, provider_settings

    no_te = kernels.settings(is_cpu=False, probe=lambda need: "absent")   # no kernel imports: no TE
    assert no_te["moe_grouped_gemm"] is False
    modules = provider_settings.recompute_settings("selective", no_te["moe_grouped_gemm"])["recompute_modules"]
    assert modules == list(selective_modules(grouped_gemm=False)) == [
        "moe", "mlp", "shared_experts", "layernorm", "core_attn"]
    overrides = ["topology=ultra_6n4g", "model=tiny_nemotron_h", "model.dtype=float32",
                 "topology.train.expert_parallel=1", "topology.train.recompute=selective",
                 "grpo.max_total_sequence_length=64", "vllm.max_model_len=64"]
    cfg = typed(compose(overrides))
    layout = plan_mod.build(cfg.topology)
    with_te, without = (activations.estimate(cfg, layout, 512, transformer_engine=te) for te in (True, False))
    per_token = 64 * 4 / 2     # 64 tokens x 4 bytes over TP 2
    # layer inputs and norms, in hidden widths: with TE M 2 + 2, * 2 + 2 (norm fused into linear_qkv), E 1 (its
    # pre-MLP norm recomputed), - 2 (fused into linear_fc1) = 11; without, * 1 + 1 and - 1 (recomputed) = 8
    assert terms(with_te)["layer inputs and norms"] == 11 * 128 * per_token == 180_224
    assert terms(without)["layer inputs and norms"] == 8 * 128 * per_token == 131_072
    for t in (with_te, without):
        assert terms(t)["Mamba"] == 2 * TINY_MAMBA * per_token == 182_272
        assert terms(t)["attention"] == 2 * TINY_ATTENTION * per_token == 147_456   # core_attn: no probabilities
        assert "MLP" not in terms(t) and "experts" not in terms(t)                 # mlp, moe recomputed
    # the largest layer rebuilt in the backward is the MoE layer, per token in bytes: its input and norm 2 x 128
    # x 4, the router's logits and scores 2 x 4 experts x 4 (fp32), the dispatch 2 x 128 x 4, the experts 2 x (64
    # + 64 + 128) x 4, the shared expert 2 x 64 x 4 = 4640, less its input kept (128 x 4) = 4128
    moe = 2 * 128 * 4 + 2 * 4 * 4 + 2 * 128 * 4 + 2 * (64 + 64 + 128) * 4 + 2 * 64 * 4 - 128 * 4
    assert moe == 4128
    assert terms(without)["one layer rebuilt in the backward"] == moe * 64 / 2 == 132_096
    # without recompute the local attention keeps its probabilities (2 layers x 4 heads x 64 x 4 bytes per token)
    cfg.topology.train.recompute = "none"
    without = activations.estimate(cfg, layout, 512, transformer_engine=False)
    assert terms(without)["attention probabilities"] == 2 * 4 * 64 * 4 * 64 / 2 == 65_536
    assert "attention probabilities" not in terms(activations.estimate(cfg, layout, 512))   # TE: fused


def test_every_vllm_term_is_the_hand_computed_one_kv_counts_k_and_v():
    _, m = plan_of("topology=ultra_6n4g")
    assert line(m.engine, "weights (TP 8)") == pytest.approx(((PARAMETERS - REPLICATED) / 8 + REPLICATED) * 2 / GIB)
    assert line(m.engine, "activations") == memory.ENGINE_ACTIVATIONS_GIB
    # K and V of 12 attention layers, 2 KV heads replicated to 1 per worker at TP 8, head 128, bf16, 4096 tokens
    assert line(m.engine, "KV of one max_model_len sequence") == 2 * 12 * 1 * 128 * 2 * 4096 / GIB
    # 48 Mamba layers: conv state (kernel 4 - 1) x (inner / 8 + 2 x 1 group x 128) in bf16, SSM 32 x 64 x 128 fp32
    assert line(m.engine, "Mamba state") == 48 * (3 * (INNER / 8 + 2 * 1 * STATE) * 2 + 32 * 64 * STATE * 4) / GIB
    assert m.budget_gib == pytest.approx(0.8 * 184)
    assert line(m.engine_outside, "refit buckets") == 2 * 256 * 2**20 / GIB
    # a merged refit: one MoE layer's experts (the pattern's 48 MoE layers share the experts)
    assert line(m.engine_outside, "merged refit") == pytest.approx(EXPERT_PARAMETERS / 48 * 2 / GIB)
    assert line(m.engine_outside, "the layer it materialises (TP 8)") == pytest.approx(
        EXPERT_PARAMETERS / 48 / 8 * 2 / GIB)
    assert line(m.engine_outside, "refit group") == memory.REFIT_GROUP_GIB
    _, m = plan_of("topology=ultra_6n4g", "refit=merged_delta")
    qkv = H * (64 + 2 * 2) * 128
    assert line(m.engine_outside, "merged_delta") == pytest.approx(2 * qkv * 2 / GIB)
    assert "merged_delta keeps the targeted modules' base weights in host memory: " \
           f"{(qkv + 64 * 128 * H) * 12 * 2 * 4 / GIB:.1f} GiB per generation node (4 vLLM workers)" in m.notes


def test_a_step_whose_sequences_overflow_the_kv_cache_is_noted():
    _, m = plan_of("topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.74")
    kv = 2 * 12 * 1 * 128 * 2 * 4096 / GIB + line(m.engine, "Mamba state")
    left = 0.74 * 184 - sum(x.gib for x in m.engine)
    assert 0 < left < 16 * kv and m.errors == []
    assert m.notes == [f"the KV cache ({left:.1f} GiB) holds less than a step's 16 sequences of 4096 tokens per "
                       f"engine ({16 * kv:.1f} GiB): vLLM queues them"]


def test_activations_that_do_not_fit_name_the_first_change_that_makes_them():
    """The reference recipe as it stood (micro_batch_size 0: the rank's 2 sequences at once, no recompute) is
    refused; the line names what fits."""
    cfg, m = plan_of("topology=ultra_6n4g", "topology.train.micro_batch_size=0", "topology.train.recompute=none")
    assert [e.key for e in m.errors] == ["topology.train.recompute"]
    msg = str(m.errors[0])
    assert msg.startswith("topology.train.recompute: a trainer rank needs 99.0 GiB (weights")
    assert "+ activations 176.3 GiB for 2 x 4096 tokens at recompute none (+25% margin) on a 184 GiB GPU" in msg
    assert msg.endswith("set topology.train.recompute=selective (activations 50.7 GiB)")
    assert [str(e) for e in validate(cfg)] == [msg]
    _, m = plan_of("topology=ultra_6n4g", "topology.train.micro_batch_size=0", "topology.train.recompute=none",
                   "topology.gpu_memory_gib=210")
    assert [str(e).rsplit(": ", 1)[-1] for e in m.errors] == [
        "set topology.train.micro_batch_size=1 (activations 88.1 GiB)"]
    _, m = plan_of("topology=ultra_6n4g", "topology.gpu_memory_gib=104")
    assert str(m.errors[0]).startswith("topology.train.tensor_parallel: a trainer rank needs 99.0 GiB")
    assert str(m.errors[0]).endswith("more than fits with micro_batch_size 1 and recompute full: raise "
                                     "topology.train.tensor_parallel or pipeline_parallel")


def test_vllm_at_the_old_default_share_is_refused_naming_the_key():
    cfg, m = plan_of("topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.6")
    assert [e.key for e in m.errors] == ["vllm.gpu_memory_utilization"]
    msg = str(m.errors[0])
    assert msg.startswith("vllm.gpu_memory_utilization: 0.6 x 184 GiB = 110.4 GiB cannot hold weights (TP 8) 131.0")
    assert msg.endswith("set it to at least 0.74 (at most 0.87: refit needs 23.4 GiB outside it)")
    assert [str(e) for e in validate(cfg)] == [msg]


def test_too_large_a_share_leaves_no_room_for_a_merged_refit():
    _, m = plan_of("topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.95")
    assert [str(e) for e in m.errors] == [
        "vllm.gpu_memory_utilization: 0.95 leaves 9.2 GiB outside vLLM's budget, refit needs 23.4 (refit buckets "
        "0.5 + merged refit: one module's weights held by vLLM's layerwise reload 19.9 + the layer it materialises "
        "(TP 8) 2.5 + refit group 0.5): set it to at most 0.87"]
    _, m = plan_of("topology=ultra_6n4g", "vllm.gpu_memory_utilization=0.95", "refit=adapter")
    assert m.errors == []  # an adapter refit loads no weights into vLLM


def test_a_gpu_too_small_for_the_engine_and_a_full_fine_tune_too_large_for_the_trainers():
    _, m = plan_of("topology=ultra_6n4g", "topology.gpu_memory_gib=80")  # an H100
    assert [e.key for e in m.errors] == ["topology.train.tensor_parallel", "topology.generation.tensor_parallel"]
    assert str(m.errors[1]).endswith("on a 80 GiB GPU (topology.gpu_memory_gib) at TP 8: raise "
                                     "topology.generation.tensor_parallel")
    _, m = plan_of("topology=ultra_6n4g", "peft=none", "refit=merged")  # every weight trains: grads + Adam
    assert [e.key for e in m.errors] == ["topology.train.tensor_parallel"]
    assert line(m.trainer, "grads") == pytest.approx((DENSE / TP + REPLICATED + EXPERT_PARAMETERS / 16) * 4 / GIB)


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
           "layers) 5.2 + Mamba (48 layers) 15.4 + attention (12 layers) 0.8" in out
    assert "DOES NOT FIT" not in out and f"facts_from: {ultra}/config.json" in out
    _, from_conf = plan_of("topology=ultra_6n4g")
    cfg, from_file = plan_of("topology=ultra_6n4g", f"model.path={ultra}")
    assert from_file.activations == from_conf.activations and from_file.trainer == from_conf.trainer
    assert main(["topology=ultra_6n4g", f"model.path={ultra}", f"run.root={runs}", "dry_run=true",
                 "topology.gpu_memory_gib=140"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: topology.generation.tensor_parallel: a vLLM worker "
                                                         "needs 158.4 GiB")
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
    # each MoE layer's router (experts x hidden) is whole on every TP rank: 2 layers x 4 x 64
    routers = {n: p.numel() for n, p in params.items() if n.endswith(".mlp.gate.weight")}
    assert size.replicated_parameters == sum(routers.values()) == 2 * 4 * 64
    assert size.source.endswith("(safetensors headers)")
