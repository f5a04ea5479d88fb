"""The vLLM executor an engine runs is pinned: "uni" in the actor's process (CPU, TP 1), or vLLM
0.32's default Ray executor, RayExecutorV2, for TP > 1 on cuda, with its worker ranking pinned to
the placement group's bundle order (VLLM_RAY_BUNDLE_INDICES), which launcher.plan pins to nodes.
Checked against vLLM's own executor resolution (vllm/v1/executor/abstract.py Executor.get_class)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from launcher.config.compose import compose
from launcher.config.schema import typed
from launcher.config.validate import validate
from workers.generator.actor import RAY_EXECUTOR, UNI_EXECUTOR, GeneratorConfig


def test_tp8_on_cuda_pins_ray_executor_v2_and_the_bundle_order():
    cfg = GeneratorConfig(model="m", device="cuda", tensor_parallel=8)
    assert cfg.executor_class() == RAY_EXECUTOR
    assert cfg.engine_env() == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "1",
                                "VLLM_RAY_BUNDLE_INDICES": "0,1,2,3,4,5,6,7"}
    kw = cfg.engine_kwargs()
    assert kw["distributed_executor_backend"] == "ray" and kw["tensor_parallel_size"] == 8


@pytest.mark.parametrize("device,tp", [("cuda", 1), ("cpu", 1)])
def test_one_worker_runs_in_the_actor(device, tp):
    cfg = GeneratorConfig(model="m", device=device, tensor_parallel=tp)
    assert cfg.executor_class() == UNI_EXECUTOR
    assert cfg.engine_env() == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert cfg.engine_kwargs()["distributed_executor_backend"] == "uni"


@pytest.mark.parametrize("device,tp", [("cuda", 8), ("cuda", 1), ("cpu", 1)])
def test_the_named_class_is_the_one_vllm_resolves_under_that_environment(device, tp, monkeypatch):
    from vllm.v1.executor.abstract import Executor

    cfg = GeneratorConfig(model="m", device=device, tensor_parallel=tp)
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")  # a site that chose V1: the engine pins V2
    for key, value in cfg.engine_env().items():
        monkeypatch.setenv(key, value)
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
        distributed_executor_backend=cfg.engine_kwargs()["distributed_executor_backend"]))
    cls = Executor.get_class(vllm_config)
    assert f"{cls.__module__}.{cls.__qualname__}" == cfg.executor_class()


def test_the_ray_transport_is_refused_for_a_tp_engine_on_cuda():
    errs = validate(typed(compose(["topology=ultra_6n4g", "refit.transport=ray"])))
    assert [str(e) for e in errs if e.key == "refit.transport"] == [
        "refit.transport: ray cannot feed a TP>1 engine on cuda: vLLM's RayExecutorV2 passes refit specs to its "
        "workers through a message queue, where Ray pins each bucket's object ref for the worker's lifetime "
        "(a leak every refit); use auto (nccl) or gloo"]
    assert not [e for e in validate(typed(compose(["topology=ultra_6n4g"]))) if e.key == "refit.transport"]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_hybrid_model_runs_without_prefix_caching_on_every_device(device, tiny_model):
    """NeMo RL's Nemotron 3 Super recipe turns prefix caching off; on vLLM CPU it crashes a hybrid's long
    prefill. A model without Mamba layers keeps vLLM's default."""
    from workers.generator.actor import has_mamba_layers

    hybrid, dense_hybrid, llama = tiny_model("tiny_nemotron_h"), tiny_model("tiny_nemotron_h_dense"), tiny_model()
    assert has_mamba_layers(str(hybrid)) and has_mamba_layers(str(dense_hybrid)) and not has_mamba_layers(str(llama))
    for path in (hybrid, dense_hybrid):
        tp = 8 if device == "cuda" else 1
        kw = GeneratorConfig(model=str(path), device=device, tensor_parallel=tp).engine_kwargs()
        assert kw["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in GeneratorConfig(model=str(llama), device=device).engine_kwargs()
    assert not has_mamba_layers("/nonexistent")  # no config.json: nothing known (the preflight's stand-in name)


def _engine(device: str, model: str, *overrides: str) -> dict:
    """vllm.LLM's keyword arguments for `model` under the ultra_6n4g topology (on `device`), as the driver builds
    the engine's config (launcher.driver.start: from the plain run config and the plan's engine TP)."""
    from dataclasses import asdict

    from launcher import plan as plan_mod

    cfg = typed(compose(["topology=ultra_6n4g", f"topology.device={device}", *overrides]))
    tp = plan_mod.build(cfg.topology).generation_tp if device == "cuda" else 1
    return GeneratorConfig.from_run_config(asdict(cfg), model, tp).engine_kwargs()


ULTRA_ENGINE = {"attention_backend": "FLASH_ATTN", "max_num_seqs": 256, "mamba_ssm_cache_dtype": "float32",
                "compilation_config": {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8],
                                       "pass_config": {"fuse_allreduce_rms": False}}}


def test_the_reference_topology_pins_nemo_rls_ultra_engine_settings_for_a_hybrid_moe(tiny_model):
    """topology=ultra_6n4g gives the engine of a hybrid MoE (Nemotron-H's layer pattern, experts) NeMo RL's Ultra
    settings on cuda (conf/topology/ultra_6n4g.yaml names the recipe files); on cpu only what vLLM CPU runs: no
    attention or MoE kernel choice, no graphs, but the same sequence budget and SSM state dtype."""
    hybrid = str(tiny_model("tiny_nemotron_h"))
    cuda = _engine("cuda", hybrid)
    assert {k: cuda[k] for k in ULTRA_ENGINE} == ULTRA_ENGINE and cuda["enable_prefix_caching"] is False
    assert "moe_backend" not in cuda  # auto: vLLM's own choice unless the topology names one
    assert _engine("cuda", hybrid, "topology.generation.moe_backend=flashinfer_cutlass")["moe_backend"] == \
        "flashinfer_cutlass"
    cpu = _engine("cpu", hybrid)
    assert {k: cpu.get(k) for k in ("attention_backend", "moe_backend", "compilation_config")} == dict.fromkeys(
        ("attention_backend", "moe_backend", "compilation_config"))
    assert cpu["max_num_seqs"] == 256 and cpu["mamba_ssm_cache_dtype"] == "float32"
    plain = GeneratorConfig(model=hybrid, device="cuda", tensor_parallel=8).engine_kwargs()
    assert not set(plain) & {"attention_backend", "moe_backend", "compilation_config", "max_num_seqs",
                             "mamba_ssm_cache_dtype"}  # the schema's defaults leave every choice to vLLM


@pytest.mark.parametrize("override, message", [
    ("topology.generation.moe_backend=cutlas", "topology.generation.moe_backend: must be one of auto, triton"),
    ("topology.generation.cudagraph_mode=piecewise", "topology.generation.cudagraph_mode: must be one of NONE, "
                                                     "PIECEWISE"),
    ("topology.generation.cudagraph_capture_sizes=[4,2]", "topology.generation.cudagraph_capture_sizes: must be a "
                                                          "list of integers >= 1 in increasing order"),
    ("topology.generation.cudagraph_capture_sizes=[0]", "topology.generation.cudagraph_capture_sizes: must be a "
                                                        "list of integers >= 1"),
    ("topology.generation.max_num_seqs=0", "topology.generation.max_num_seqs: must be at least 1 or null"),
    ("topology.generation.mamba_ssm_cache_dtype=fp32", "topology.generation.mamba_ssm_cache_dtype: must be one of "
                                                       "auto, float32, float16, bfloat16"),
    ("topology.generation.attention_backend=FLASH", "topology.generation.attention_backend: must be one of "
                                                    "FLASH_ATTN"),
])
def test_an_engine_setting_vllm_does_not_accept_is_one_line(override, message):
    errs = [str(e) for e in validate(typed(compose(["topology=ultra_6n4g", override])))]
    assert any(e.startswith(message) for e in errs), errs
