"""vLLM generators and refit, end to end on CPU: real vLLM (in-process), real Ray, float32.

After each refit mode the generators' greedy tokens and logprobs must equal HF transformers on
the trainer's merged weights (and HF PeftModel for the adapter mode); merged_delta must write
bitwise the tensors merged writes; a refit without the prefix-cache reset must be caught.
The trainer here is `LoraStandin` (HF checkpoint + random LoRA factors in Megatron layout, merged
the way Megatron-Bridge merges) running in its own Ray actor, as the real trainer would.
Engines are module-scoped: two plain engines (to test the split across engines) and one with LoRA.
"""

from __future__ import annotations

import socket

import pytest
import torch

from workers import refit
from workers.generator import GeneratorConfig
from workers.generator_group import GeneratorGroup
from workers.lora_standin import ALL_LINEAR, LoraStandin

pytestmark = pytest.mark.integration

N_NEW = 10
ATOL = 1e-4  # float32 logprobs, vLLM CPU kernels vs torch (measured ~2e-6)
# three engines on the fixture's 2 generation slots: each takes half of one
SLOT = {"resources": {"generation_slot": 0.5}, "num_cpus": 0.5}


def prompts(n: int = 5, seed: int = 0, length: tuple[int, int] = (3, 12)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 250, (int(torch.randint(length[0], length[1], (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


# ---------------------------------------------------------------------------- HF references


def _hf_model(model_dir, state=None, adapter_dir=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids, n_new=N_NEW):
    """Greedy tokens and the log-softmax logprob of each, one full forward per step."""
    out = []
    for p in prompt_ids:
        ids, toks, lps = list(p), [], []
        for _ in range(n_new):
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            tok = int(logprobs.argmax())
            toks.append(tok)
            lps.append(float(logprobs[tok]))
            ids.append(tok)
        out.append((toks, lps))
    return out


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


@pytest.fixture(scope="module")
def producer(local_ray, model_dir):
    # megatron.core rebinds torch.storage._load_from_bytes when imported, so tensors pickled in a
    # process that imported it (the stand-in merges with Megatron-Bridge) unpickle only where
    # megatron.core imports too: on CPU that needs the shim. Refit buckets are numpy: unaffected.
    from workers import cpu_shim

    cpu_shim.apply("cpu")
    import megatron.core  # noqa: F401

    ray = local_ray
    actor = ray.remote(LoraStandin).options(num_cpus=0).remote(model_dir, ALL_LINEAR, dim=8, alpha=16, seed=1)
    yield actor
    ray.kill(actor)


@pytest.fixture(scope="module")
def engines(local_ray, model_dir):
    group = GeneratorGroup(GeneratorConfig(model=model_dir, kv_cache_memory_bytes=32 * 2**20), [SLOT, SLOT],
                           ready_timeout_s=300)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def lora_engine(local_ray, model_dir):
    config = GeneratorConfig(model=model_dir, kv_cache_memory_bytes=32 * 2**20, enable_lora=True, max_lora_rank=8)
    group = GeneratorGroup(config, [SLOT], ready_timeout_s=300)
    yield group
    group.shutdown()


def refit_to_producer(ray, producer, group, mode, bucket_mb=0.05, **apply_kwargs):
    """One refit through the object store; returns (payload, generator report)."""
    payload = ray.get(producer.refit_payload.remote(mode, bucket_mb))
    return payload, group.apply_refit(payload, **apply_kwargs)


# ---------------------------------------------------------------------------- generation


def test_base_generation_matches_hf_and_keeps_request_order(engines, model_dir):
    ps = prompts(5)
    gens = greedy(engines, ps)  # 5 prompts over 2 engines: slices of 3 and 2
    assert_matches(gens, hf_greedy(_hf_model(model_dir), ps))
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


# ---------------------------------------------------------------------------- refit modes


def test_merged_refit_matches_hf_on_merged_weights(local_ray, engines, producer, model_dir):
    ps = prompts(4, seed=5)
    before = greedy(engines, ps)
    payload, report = refit_to_producer(local_ray, producer, engines, "merged", bucket_mb=0.05)
    assert payload.layout_bytes > 0 and report["layouts_fetched"] == 2  # first refit: both engines get it
    assert report["buckets"] == len(payload.buckets) > 1                 # bounded buckets, several
    assert payload.bytes >= sum(t.numel() * 4 for t in local_ray.get(producer.merged_state.remote()).values())
    gens = greedy(engines, ps)
    assert [g.token_ids for g in gens] != [g.token_ids for g in before]  # the LoRA delta matters
    merged = local_ray.get(producer.merged_state.remote())
    assert_matches(gens, hf_greedy(_hf_model(model_dir, merged), ps))
    # second refit: same layout, only buckets travel
    local_ray.get(producer.step.remote())
    payload, report = refit_to_producer(local_ray, producer, engines, "merged", bucket_mb=0.05)
    assert payload.layout_bytes == 0 and report["layouts_fetched"] == 0
    merged = local_ray.get(producer.merged_state.remote())
    assert_matches(greedy(engines, ps), hf_greedy(_hf_model(model_dir, merged), ps))


def test_merged_delta_writes_bitwise_the_merged_weights(local_ray, engines, producer, model_dir):
    ps = prompts(4, seed=6)
    local_ray.get(producer.step.remote())
    engines.call("refit_record", True)
    try:
        merged_payload, _ = refit_to_producer(local_ray, producer, engines, "merged")
        written_merged = engines.call("refit_recorded")
        via_merged = greedy(engines, ps)
        engines.call("refit_record", True)  # fresh record
        delta_payload, _ = refit_to_producer(local_ray, producer, engines, "merged_delta")
        written_delta = engines.call("refit_recorded")
    finally:
        engines.call("refit_record", False)
    via_delta = greedy(engines, ps)
    # only the 7 linears of each of the 2 layers are written, and bitwise as merged wrote them
    for rec_m, rec_d in zip(written_merged, written_delta):
        assert len(rec_d) == 2 * 7
        for name, tensor in rec_d.items():
            assert torch.equal(tensor, rec_m[name]), name
    assert delta_payload.bytes < merged_payload.bytes / 3
    # same weights -> the same kernels give bitwise the same logprobs
    assert [g.token_ids for g in via_delta] == [g.token_ids for g in via_merged]
    assert [g.logprobs for g in via_delta] == [g.logprobs for g in via_merged]
    merged = local_ray.get(producer.merged_state.remote())
    assert_matches(via_delta, hf_greedy(_hf_model(model_dir, merged), ps))


def test_merged_delta_after_a_training_step_matches_hf(local_ray, engines, producer, model_dir):
    """merged_delta starts from the kept base every time (it must not add deltas onto deltas)."""
    ps = prompts(3, seed=7)
    for _ in range(2):
        local_ray.get(producer.step.remote())
        refit_to_producer(local_ray, producer, engines, "merged_delta")
    merged = local_ray.get(producer.merged_state.remote())
    assert_matches(greedy(engines, ps), hf_greedy(_hf_model(model_dir, merged), ps))


def test_refit_without_prefix_cache_reset_is_caught(local_ray, engines, producer, model_dir):
    """A 300-token prompt spans two full 128-token KV blocks that the prefix cache keeps."""
    long_prompt = prompts(1, seed=8, length=(300, 301))
    local_ray.get(producer.step.remote())
    refit_to_producer(local_ray, producer, engines, "merged_delta")
    greedy(engines, long_prompt * 2)  # both engines cache the prompt's blocks under the old weights
    local_ray.get(producer.step.remote())
    expected = hf_greedy(_hf_model(model_dir, local_ray.get(producer.merged_state.remote())), long_prompt)

    def agrees() -> bool:
        try:
            assert_matches(greedy(engines, long_prompt), expected)
            return True
        except AssertionError:
            return False

    refit_to_producer(local_ray, producer, engines, "merged_delta", reset_prefix_cache=False)
    assert not agrees(), "stale prefix cache went unnoticed: this test would not catch a missing reset"
    refit_to_producer(local_ray, producer, engines, "merged_delta")  # the real path resets
    assert agrees()


def test_adapter_refit_matches_peft_model_and_merged_weights(local_ray, lora_engine, producer, model_dir, tmp_path):
    from workers import lora_layout

    ps = prompts(4, seed=9)
    local_ray.get(producer.step.remote())
    payload, report = refit_to_producer(local_ray, producer, lora_engine, "adapter")
    assert lora_engine.call("info")[0]["adapter_id"] == 1
    gens = greedy(lora_engine, ps)
    # HF PeftModel on a PEFT adapter written from the trainer's factors
    state = local_ray.get(producer.adapter_state.remote())
    cfg = local_ray.get(producer.lora_config.remote())
    layout = lora_layout.ModelLayout.from_hf_config(model_dir)
    adapter_dir = lora_layout.write_peft_adapter(tmp_path / "adapter", lora_layout.hf_lora_groups(layout, state),
                                                 cfg["dim"], cfg["alpha"], model_dir)
    assert_matches(gens, hf_greedy(_hf_model(model_dir, adapter_dir=adapter_dir), ps))
    merged = local_ray.get(producer.merged_state.remote())
    assert [g.token_ids for g in gens] == [t for t, _ in hf_greedy(_hf_model(model_dir, merged), ps)]
    # next refit: a new adapter id, and the new factors are served
    local_ray.get(producer.step.remote())
    refit_to_producer(local_ray, producer, lora_engine, "adapter")
    assert lora_engine.call("info")[0]["adapter_id"] == 2
    merged = local_ray.get(producer.merged_state.remote())
    assert_matches(greedy(lora_engine, ps), hf_greedy(_hf_model(model_dir, merged), ps))


def test_broadcast_transport_gloo_through_actors(local_ray, engines, producer, model_dir):
    """The NCCL path's code over gloo: trainer actor = rank 0, each vLLM worker joins."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world, joins = engines.open_refit_group("127.0.0.1", port, backend="gloo")
    assert world == 3  # trainer rank 0 + the one in-process worker of each engine
    local_ray.get([producer.open_refit_group.remote("127.0.0.1", port, world, "gloo")] + joins)
    try:
        ps = prompts(3, seed=10)
        for mode in ("merged", "merged_delta"):
            local_ray.get(producer.step.remote())
            report = refit.run_refit(lambda: [producer.refit_payload.remote(mode, 0.05)], engines, mode)
            assert report.transport == "broadcast" and report.bytes > 0 and report.transfer_and_update_weights_s > 0
            merged = local_ray.get(producer.merged_state.remote())
            assert_matches(greedy(engines, ps), hf_greedy(_hf_model(model_dir, merged), ps))
    finally:
        local_ray.get(producer.close_refit_group.remote())
        engines.transport = "ray"
