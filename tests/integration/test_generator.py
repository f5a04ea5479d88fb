"""vLLM generators and refit, end to end on CPU: real vLLM (in-process), real Ray, real Megatron, float32.

The trainer is the real TrainerGroup (Megatron-Bridge LoRA on all linears, TP=2: adapter_state is
TP-gathered and export_merged is the Bridge's merged export). LoRA B starts non-zero and the
trainer takes real GRPO steps between refits, so every refit changes what the generators sample.
After each refit mode the generators' greedy tokens and logprobs must equal HF transformers on the
trainer's merged weights (HF PeftModel for the adapter mode), the trainer's own logprobs of sampled
sequences must agree with the generation logprobs (gen_kl_error), merged_delta must write bitwise
the tensors merged writes, the trainer's merged export must be bitwise Megatron-Bridge's, a refit
without the prefix-cache reset must be caught, and every refit mode (and the pipelined loop's
take/deliver) must leave every tensor of the engines where it was: CUDA graphs replay kernels on the
addresses they captured, so a refit that replaced a tensor instead of copying into it would leave
them reading the old weights (vllm.enforce_eager defaults to false on cuda).
Engines are module-scoped: two plain engines (to test the split across engines) and one with LoRA.
"""

from __future__ import annotations

import pytest
import torch

from launcher.driver.agreement import agreement_metrics
from tests.helpers import hf_reference as hf
from tests.helpers.generator import RecordingGeneratorGroup, recording_config
from workers.refit import control as refit

pytestmark = pytest.mark.integration

N_NEW = 10
ATOL = 1e-4  # float32 logprobs, vLLM CPU kernels vs torch (measured ~2e-6)
# three engines on the fixture's 2 generation slots: each takes half of one
SLOT = {"resources": {"generation_slot": 0.5}, "num_cpus": 0.5}


def prompts(n: int = 5, seed: int = 0, length: tuple[int, int] = (3, 12)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 250, (int(torch.randint(length[0], length[1], (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


# ------------------------------------------------------------ HF references: tests/helpers/hf_reference.py


def assert_matches(gens, reference):
    assert [g.token_ids for g in gens] == [toks for toks, _ in reference]
    for g, (_, lps) in zip(gens, reference):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(lps), rtol=0, atol=ATOL)


def greedy(group, prompt_ids, n_new=N_NEW):
    return group.generate(prompt_ids, temperature=0.0, max_tokens=n_new, ignore_eos=True)


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("tiny_llama"))


# alpha / dim = 2.5: not a power of two, so a merge computed in another order would change bits
PEFT = {"enabled": True, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "dim": 8,
        "alpha": 20, "dropout": 0.0, "dropout_position": "post", "lora_A_init_method": "xavier",
        "lora_B_init_method": "xavier", "lora_dtype": None, "freeze_moe_router": False}  # B != 0 from the start
OPTIM = {"optimizer": "adam", "lr": 1e-2, "min_lr": 1e-2, "clip_grad": 1.0, "lr_decay_style": "constant"}


@pytest.fixture(scope="module")
def trainers(local_ray, model_dir):
    # megatron.core rebinds torch.storage._load_from_bytes when imported, so tensors pickled in a
    # trainer process unpickle only where megatron.core imports too: on CPU that needs the shim.
    # Refit buckets are numpy arrays and do not depend on this.
    from workers import cpu_shim

    cpu_shim.apply("cpu")
    import megatron.core  # noqa: F401

    from workers.trainer.config import TrainerConfig
    from tests.helpers.trainer import ProbedTrainerGroup

    config = TrainerConfig.from_sections(model_dir, parallel={"tensor_parallel": 2}, peft=PEFT, optim=OPTIM,
                                         seed=5, max_num_steps=50)
    group = ProbedTrainerGroup(config, num_ranks=2)
    yield group
    group.shutdown()


def sequences_batch(gens, prompt_ids, pad_id=0) -> dict:
    """The driver's batch contract from generations (response tokens carry generation logprobs)."""
    rows = [list(p) + g.token_ids for p, g in zip(prompt_ids, gens)]
    width = max(map(len, rows))
    batch = {"input_ids": torch.full((len(rows), width), pad_id, dtype=torch.int64),
             "loss_mask": torch.zeros(len(rows), width), "generation_logprobs": torch.zeros(len(rows), width),
             "advantages": torch.linspace(-1, 1, len(rows))}
    for i, (p, g) in enumerate(zip(prompt_ids, gens)):
        batch["input_ids"][i, :len(rows[i])] = torch.tensor(rows[i])
        batch["loss_mask"][i, len(p):len(rows[i])] = 1
        batch["generation_logprobs"][i, len(p):len(rows[i])] = torch.tensor(g.logprobs)
    return batch


def train_step(trainers, engines) -> None:
    """One real GRPO step on sequences the generators sampled (moves every adapter)."""
    ps = prompts(4, seed=42)
    batch = sequences_batch(engines.generate(ps, temperature=1.0, max_tokens=6, seeds=[1, 2, 3, 4]), ps)
    batch["prev_logprobs"] = trainers.logprobs(batch)
    trainers.train(batch)


def merged_state(trainers) -> dict:
    return dict(trainers.export_merged())


def refit_from(trainers, group, mode, bucket_mb=0.05):
    """One refit through the object store; returns (payload, generator report)."""
    payload = trainers.refit_payload(mode, bucket_mb)
    return payload, group.apply_refit(payload)


@pytest.fixture(scope="module")
def engines(local_ray, model_dir):
    # the recording subclasses (tests/helpers) add refit_record / refit_recorded to the engines
    group = RecordingGeneratorGroup(recording_config(model=model_dir, kv_cache_memory_bytes=32 * 2**20), [SLOT, SLOT],
                                    ready_timeout_s=300)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def lora_engine(local_ray, model_dir):
    config = recording_config(model=model_dir, kv_cache_memory_bytes=32 * 2**20, enable_lora=True, max_lora_rank=8)
    group = RecordingGeneratorGroup(config, [SLOT], ready_timeout_s=300)
    yield group
    group.shutdown()


# ---------------------------------------------------------------------------- generation


def test_base_generation_matches_hf_and_keeps_request_order(engines, model_dir):
    ps = prompts(5)
    gens = greedy(engines, ps)  # 5 prompts over 2 engines: slices of 3 and 2
    assert_matches(gens, hf.greedy(hf.load(model_dir), ps, N_NEW))
    assert all(g.finish_reason == "length" and isinstance(g.text, str) and g.text for g in gens)


def test_per_request_seeds_make_sampling_independent_of_batch_and_engine(engines):
    ps = prompts(4, seed=3)
    seeds = [11, 12, 13, 14]
    first = engines.generate(ps, temperature=1.0, top_p=1.0, max_tokens=8, seeds=seeds)
    # reversed batch: every request lands on the other engine, next to other requests
    again = engines.generate(ps[::-1], temperature=1.0, top_p=1.0, max_tokens=8, seeds=seeds[::-1])[::-1]
    alone = engines.generate(ps[:1], temperature=1.0, top_p=1.0, max_tokens=8, seeds=seeds[:1])
    assert [g.token_ids for g in again] == [g.token_ids for g in first]
    assert [g.logprobs for g in again] == [g.logprobs for g in first]
    assert alone[0].token_ids == first[0].token_ids
    other = engines.generate(ps, temperature=1.0, top_p=1.0, max_tokens=8, seeds=[s + 100 for s in seeds])
    assert [g.token_ids for g in other] != [g.token_ids for g in first]


def test_seeded_prompts_longer_than_one_engine_step_generate_on_cpu(engines):
    """More prompt tokens at once than one engine step takes (CPU_BATCHED_TOKENS): with chunked
    prefill a prompt split over two steps rewinds its seeded generator, which vLLM CPU refuses
    ("CPU Generator does not use offset": what long multi-turn histories met); whole prompts only."""
    from workers.generator.actor import CPU_BATCHED_TOKENS

    ps = prompts(12, seed=9, length=(300, 400))
    assert sum(map(len, ps)) > CPU_BATCHED_TOKENS
    gens = engines.generate(ps, temperature=1.0, top_p=1.0, max_tokens=4, seeds=list(range(12)))
    again = engines.generate(ps[:1], temperature=1.0, top_p=1.0, max_tokens=4, seeds=[0])
    assert all(len(g.token_ids) == 4 for g in gens) and again[0].token_ids == gens[0].token_ids


# ---------------------------------------------------------------------------- refit modes


def assert_trainer_agrees(trainers, group, seed):
    """Sampled sequences: the trainer's logprobs of the generated tokens = the generation logprobs."""
    ps = prompts(4, seed=seed)
    gens = group.generate(ps, temperature=1.0, max_tokens=8, seeds=[seed + i for i in range(4)])
    batch = sequences_batch(gens, ps)
    metrics = agreement_metrics(batch["generation_logprobs"], trainers.logprobs(batch), batch["loss_mask"])
    assert metrics["gen_kl_error"] < 1e-8 and metrics["token_mult_prob_error"] < 1 + 1e-4, metrics
    return metrics


def test_merged_refit_matches_hf_and_the_trainer(engines, trainers, model_dir):
    ps = prompts(4, seed=5)
    before = greedy(engines, ps)
    payload, report = refit_from(trainers, engines, "merged", bucket_mb=0.05)
    assert payload.layout_bytes > 0 and report["layouts_fetched"] == 2  # first refit: both engines get it
    assert report["buckets"] == len(payload.buckets) > 1                # bounded buckets, several
    merged = merged_state(trainers)
    assert payload.bytes >= sum(t.numel() * t.element_size() for t in merged.values())
    gens = greedy(engines, ps)
    assert [g.token_ids for g in gens] != [g.token_ids for g in before]  # LoRA (B != 0) matters
    assert_matches(gens, hf.greedy(hf.load(model_dir, merged), ps, N_NEW))
    assert_trainer_agrees(trainers, engines, seed=100)
    # a training step, then the second refit: same layout, only buckets travel
    train_step(trainers, engines)
    payload, report = refit_from(trainers, engines, "merged", bucket_mb=0.05)
    assert payload.layout_bytes == 0 and report["layouts_fetched"] == 0
    assert_matches(greedy(engines, ps), hf.greedy(hf.load(model_dir, merged_state(trainers)), ps, N_NEW))


def test_merged_delta_writes_bitwise_the_merged_weights(engines, trainers, model_dir):
    ps = prompts(4, seed=6)
    train_step(trainers, engines)
    engines.call("refit_record", True)
    try:
        merged_payload, _ = refit_from(trainers, engines, "merged")
        written_merged = engines.call("refit_recorded")
        via_merged = greedy(engines, ps)
        engines.call("refit_record", True)  # a fresh record
        delta_payload, _ = refit_from(trainers, engines, "merged_delta")
        written_delta = engines.call("refit_recorded")
        # the loader ran inside the engine's config context, as vLLM's own Worker.reload_weights runs it
        assert engines.call("refit_recorded_in_config") == [True, True]
    finally:
        engines.call("refit_record", False)
    via_delta = greedy(engines, ps)
    # only the 7 linears of each of the 2 layers are written, bitwise as the Bridge's export has them
    for rec_m, rec_d in zip(written_merged, written_delta):
        assert len(rec_d) == 2 * 7
        for name, tensor in rec_d.items():
            assert torch.equal(tensor, rec_m[name]), name
    assert delta_payload.bytes < merged_payload.bytes / 3
    # the same weights -> the same kernels give bitwise the same logprobs
    assert [g.token_ids for g in via_delta] == [g.token_ids for g in via_merged]
    assert [g.logprobs for g in via_delta] == [g.logprobs for g in via_merged]
    assert_matches(via_delta, hf.greedy(hf.load(model_dir, merged_state(trainers)), ps, N_NEW))
    assert_trainer_agrees(trainers, engines, seed=200)


def test_merged_delta_after_training_steps_matches_hf(engines, trainers, model_dir):
    """merged_delta starts from the kept base every time (it must not add deltas onto deltas)."""
    ps = prompts(3, seed=7)
    for _ in range(2):
        train_step(trainers, engines)
        refit_from(trainers, engines, "merged_delta")
    assert_matches(greedy(engines, ps), hf.greedy(hf.load(model_dir, merged_state(trainers)), ps, N_NEW))


def test_refit_without_prefix_cache_reset_is_caught(engines, trainers, model_dir):
    """A 300-token prompt spans two full 128-token KV blocks that the prefix cache keeps."""
    long_prompt = prompts(1, seed=8, length=(300, 301))
    train_step(trainers, engines)
    refit_from(trainers, engines, "merged_delta")
    greedy(engines, long_prompt * 2)  # both engines cache the prompt's blocks under these weights
    train_step(trainers, engines)
    expected = hf.greedy(hf.load(model_dir, merged_state(trainers)), long_prompt, N_NEW)

    def agrees() -> bool:
        try:
            assert_matches(greedy(engines, long_prompt), expected)
            return True
        except AssertionError:
            return False

    engines.apply_refit_keeping_prefix_cache(trainers.refit_payload("merged_delta", 0.05))
    assert not agrees(), "stale prefix cache went unnoticed: this test would not catch a missing reset"
    refit_from(trainers, engines, "merged_delta")  # the real path resets
    assert agrees()


def test_adapter_refit_matches_peft_model_and_the_trainer(lora_engine, engines, trainers, model_dir, tmp_path):
    from workers.lora import layout as lora_layout, peft as lora_peft

    ps = prompts(4, seed=9)
    train_step(trainers, engines)
    refit_from(trainers, lora_engine, "adapter")
    assert lora_engine.call("info")[0]["adapter_id"] == 1
    gens = greedy(lora_engine, ps)
    # HF PeftModel on a PEFT adapter written from the trainer's factors
    cfg = trainers.lora_config()
    groups = lora_layout.hf_lora_groups(lora_layout.ModelLayout.from_hf_config(model_dir), trainers.adapter_state())
    adapter_dir = lora_peft.write_peft_adapter(tmp_path / "adapter", groups, cfg["dim"], cfg["alpha"], model_dir)
    assert_matches(gens, hf.greedy(hf.load(model_dir, adapter_dir=adapter_dir), ps, N_NEW))
    merged_reference = hf.greedy(hf.load(model_dir, merged_state(trainers)), ps, N_NEW)
    assert [g.token_ids for g in gens] == [t for t, _ in merged_reference]
    assert_trainer_agrees(trainers, lora_engine, seed=300)
    # next step and refit: a new adapter id, and the new factors are served
    train_step(trainers, engines)
    refit_from(trainers, lora_engine, "adapter")
    assert lora_engine.call("info")[0]["adapter_id"] == 2
    assert_matches(greedy(lora_engine, ps), hf.greedy(hf.load(model_dir, merged_state(trainers)), ps, N_NEW))


def test_broadcast_transport_gloo_through_actors(engines, trainers, model_dir):
    """The NCCL path's code over gloo: trainer rank 0 hosts the group, each vLLM worker joins."""
    sync = refit.make_refit(trainers, engines, "gloo", "cpu", "merged", 0.05)
    assert sync.transport == "gloo" and not sync.deferrable
    sync.connect()
    try:
        ps = prompts(3, seed=10)
        for version, mode in enumerate(("merged", "merged_delta"), start=1):
            train_step(trainers, engines)
            sync.mode = mode
            assert sync.is_stale(version)
            report = sync.push(version)
            assert not sync.is_stale(version) and sync.is_stale(version + 1)
            assert report.transport == "broadcast" and report.bytes > 0 and report.transfer_and_update_weights_s > 0
            assert report.buckets > 1
            assert_matches(greedy(engines, ps), hf.greedy(hf.load(model_dir, merged_state(trainers)), ps, N_NEW))
    finally:
        sync.close()
    assert engines.transport == "ray" and sync.generators_version is None


def test_a_workers_loader_error_ends_the_broadcast_refit_naming_it(trainers, model_dir):
    """Two engines join trainer rank 0's gloo group; engine 1's vLLM loader fails on one tensor. It
    reads the rest of the refit, so the sender and engine 0 finish (engine 0 with every weight) and
    the error names the worker and the tensor; each ray.get has a timeout far below the group's
    (a hang guard: without the drain all three would wait for the group's collectives). Both sides
    took refit.timeout_s from connect(). After a loader error an engine's model is half reloaded
    (vLLM's layerwise reload has no rollback): the run ends there, so these engines are the test's own."""
    import ray

    from workers.refit.transports import BroadcastTransport

    slot = {"resources": {"generation_slot": 0.25}, "num_cpus": 0.25}
    group = RecordingGeneratorGroup(recording_config(model=model_dir, kv_cache_memory_bytes=32 * 2**20), [slot, slot],
                                    ready_timeout_s=300)
    bad = "model.layers.1.self_attn.o_proj.weight"
    try:
        sync = refit.make_refit(trainers, group, "gloo", "cpu", "merged", 0.05, timeout_s=900)
        sync.connect()
        timeouts = [ray.get(trainers.actors[0].__ray_call__.remote(lambda t: t.refit_sender.transport.group.timeout_s))]
        timeouts += ray.get([a.__ray_call__.remote(lambda g: g.llm.collective_rpc(
            lambda w: w._refit_receivers()["broadcast"].group.timeout_s)[0]) for a in group.actors])
        assert timeouts == [900, 900, 900]
        group.call("refit_record", True)
        ray.get(group.actors[1].refit_rename.remote(bad, bad + "_not_in_the_model"))
        train_step(trainers, engines=group)
        senders = [a.refit_payload.remote("merged", 0.05) for a in trainers.actors]
        received = group.start_refit(BroadcastTransport.expect("merged"))
        payload = ray.get(senders[0], timeout=120)
        assert payload.transport == "broadcast" and payload.tensors > 10
        assert ray.get(received[0], timeout=120)["buckets"] > 1
        with pytest.raises(ray.exceptions.RayTaskError) as failed:
            ray.get(received[1], timeout=120)
        from workers.trainer.group import task_error_line

        line = task_error_line(failed.value)
        assert line.startswith("RefitError: vLLM worker 0 (") and f"failed in the merged refit at {bad!r}: " in line
        assert "_not_in_the_model" in line, line  # vLLM's own loader error, in the same line
        written = ray.get(group.actors[0].refit_recorded.remote())
        assert written.keys() == dict(merged_state(trainers)).keys()
        assert all(torch.equal(t, written[n]) for n, t in merged_state(trainers).items())
    finally:
        trainers.close_refit_group()
        group.shutdown()


def test_the_merged_export_is_bitwise_megatron_bridges(trainers):
    """export_merged() merges the Bridge's base export with the gathered LoRA factors itself
    (workers.trainer.merged_export); at TP=2 with LoRA on every linear it must equal the Bridge's own
    merged export (export_hf_weights(merge_adapter_weights=True)) name for name, bit for bit."""
    ours, bridge = trainers.call("export_merged_state", keep="rank0")[0], trainers.call("bridge_merged_state")[0]
    assert [n for n, _ in ours] == [n for n, _ in bridge] and len(ours) == 2 * 9 + 3
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours, bridge))


# ---------------------------------------------------------------------------- refit in place (CUDA graphs)


def mark(group) -> None:
    """Every engine remembers where each tensor of its model lives. Not vacuous: the weights that
    keep their data on a CPU engine (embedding, norms, lm_head; a linear's weight is packed into its
    oneDNN kernel and its Parameter left empty, on a GPU it is the kernel's operand), the KV cache and,
    with LoRA, the adapter slots (vLLM's LoRA layers wrap the linears and the embedding: their
    weights are `<module>.base_layer.weight` there)."""
    for m in group.call("refit_storage_mark"):
        names = {n.replace(".base_layer.", ".") for n in m["names"]}
        assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.down_proj.weight"} <= names
        assert any(n.endswith(".attn.kv_cache") for n in names) and m["with_data"] > 10 and m["bytes"] > 2**20


def logprobs_of(group, ps) -> list:
    return [g.logprobs for g in greedy(group, ps)]


@pytest.mark.parametrize("mode", ["merged", "merged_delta"])
def test_refits_write_every_tensor_of_the_engines_in_place(engines, trainers, mode):
    ps = prompts(3, seed=11)
    mark(engines)
    before = logprobs_of(engines, ps)
    for _ in range(3):
        train_step(trainers, engines)
        refit_from(trainers, engines, mode)
        greedy(engines, ps)
    assert logprobs_of(engines, ps) != before  # the refits changed the weights...
    assert engines.call("refit_storage_moved") == [[], []]  # ...where they were


def test_adapter_refits_keep_every_tensor_in_place(lora_engine, engines, trainers):
    ps = prompts(3, seed=12)
    mark(lora_engine)
    assert any("lora_a_stacked" in n for n in lora_engine.call("refit_storage_mark")[0]["names"])
    before = logprobs_of(lora_engine, ps)
    for _ in range(3):
        train_step(trainers, engines)
        refit_from(trainers, lora_engine, "adapter")
        greedy(lora_engine, ps)  # activates the new adapter in vLLM's LoRA slots
    assert logprobs_of(lora_engine, ps) != before
    assert lora_engine.call("refit_storage_moved") == [[]]


def test_the_pipelined_loops_take_and_deliver_write_in_place(engines, trainers, model_dir):
    """The pipelined loop takes the trainers' weights into the object store and delivers them later,
    while the trainers train on (workers.refit.control.ObjectStoreRefit)."""
    sync = refit.ObjectStoreRefit(trainers, engines, "merged", 0.05)
    ps = prompts(3, seed=13)
    mark(engines)
    first = sync.take(1)
    train_step(trainers, engines)
    second = sync.take(2)
    expected = hf.greedy(hf.load(model_dir, merged_state(trainers)), ps, N_NEW)
    sync.deliver(first)
    greedy(engines, ps)
    train_step(trainers, engines)
    sync.deliver(second)
    assert_matches(greedy(engines, ps), expected)  # the second snapshot, not the trainers' newer weights
    assert engines.call("refit_storage_moved") == [[], []]


# a user's chat template without special tokens (the tiny tokenizer's words): "role : content ." per message
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
                  "{% if add_generation_prompt %}assistant :{% endif %}")
TWO_TURNS = """
class Env:
    def __init__(self, example):
        self.turn = 0

    def first_messages(self):
        return [{"role": "user", "content": "what is 2 + 3 ?"}]

    def respond(self, reply):
        self.turn += 1
        return {"messages": [{"role": "user", "content": "no , say the answer"}], "reward": 0.5, "done": False}
"""


def test_a_two_turn_episodes_model_tokens_agree_with_the_trainer(engines, trainers, model_dir, tmp_path):
    """Real engines sample two-turn episodes (launcher.driver.episodes, the environment in a reward
    worker): on every model token of both turns, after the environment's tokens, the trainer's
    logprobs equal vLLM's (float32), and the environment's tokens are outside the loss mask."""
    from transformers import AutoTokenizer

    from launcher.config.compose import compose
    from launcher.config.schema import typed
    from launcher.driver import episodes
    from launcher.driver.data import Example
    from launcher.driver.environments import Environments
    from launcher.driver.rollout import build_batch

    refit_from(trainers, engines, "merged")  # the engines hold the trainers' weights
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = PLAIN_TEMPLATE
    (tmp_path / "env.py").write_text(TWO_TURNS)
    cfg = typed(compose([f"env.fn={tmp_path / 'env.py'}:Env", "grpo.num_generations_per_prompt=2",
                         "grpo.max_new_tokens=6", "grpo.max_turns=2", "reward.workers=1"]))
    envs = Environments(cfg, tmp_path / "run")
    try:
        r = episodes.sample(cfg, engines, envs, tok, [Example(i, {}) for i in range(2)], step=1)
    finally:
        envs.close()
    assert [m["env/turns"] for m in r.episodes] == [2] * 4 and r.rewards == [1.0] * 4
    batch = build_batch(r, [1.0, -1.0, 0.5, -0.5], tok.pad_token_id)
    for i, (p, s) in enumerate(zip(r.prompt_ids, r.response_ids)):
        env = [t for t, m in zip(s, r.response_mask[i]) if not m]
        # the end of the reply's turn as the template writes it, the environment's message, the generation prompt
        assert env == tok(" . user : no , say the answer . assistant :", add_special_tokens=False)["input_ids"]
        assert batch["loss_mask"][i, len(p):len(p) + len(s)].sum() == sum(r.response_mask[i]) < len(s)
    metrics = agreement_metrics(batch["generation_logprobs"], trainers.logprobs(batch), batch["loss_mask"])
    assert metrics["gen_kl_error"] < 1e-5 and metrics["token_mult_prob_error"] < 1 + 1e-4, metrics


@pytest.mark.parametrize("how", ["parameter", "data"])
def test_a_refit_that_replaces_a_parameter_is_caught(engines, trainers, how):
    """The check fails on a refit that puts the same values in a new tensor instead of copying into
    the old one (a new Parameter on the module, or the Parameter's .data pointed elsewhere), on the
    engine that did it only."""
    import ray

    mark(engines)
    ray.get(engines.actors[1].refit_plant_replace.remote("model.norm.weight", how))
    train_step(trainers, engines)
    refit_from(trainers, engines, "merged")
    assert engines.call("refit_storage_moved") == [[], ["model.norm.weight"]]
