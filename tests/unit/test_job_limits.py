"""The job's limits (launcher.config.job_limits, model_rules' rope, the schema's temperature and
durations) agree with the components that enforce them in the job: vLLM's own functions (in one
subprocess: SamplingParams, get_rope, the max_model_len derivation) and megatron-core's
OptimizerParamScheduler (its constructor and load_state_dict). Each table row is a value a user
could write or a checkpoint could hold; the launcher must refuse exactly what the component refuses
(besides the few values noted, where the launcher is stricter on purpose)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.config.schema import Config

REPO = Path(__file__).resolve().parents[2]


def test_every_duration_has_a_bound_a_timedelta_holds():
    """Each `*_s` key is at most MAX_SECONDS: the job turns them into timedeltas, socket and torch timeouts
    (refit.timeout_s=1e20 overflowed timedelta in the job after the launcher accepted it)."""
    from launcher.config.fields import Elsewhere, Range, leaves
    from launcher.config.schema import MAX_SECONDS

    # seconds end in _s; a rate per second (topology.interconnect_gb_s, GB/s) is no duration
    durations = [leaf for leaf in leaves(Config) if leaf.key.endswith("_s") and not leaf.key.endswith("_gb_s")]
    assert {leaf.key for leaf in durations} >= {"refit.timeout_s", "ray.register_timeout_s", "reward.timeout_s"}
    for leaf in durations:
        if isinstance(leaf.check, Elsewhere):   # slurm.signal_delay_s: below slurm.time_min's seconds
            continue
        assert isinstance(leaf.check, Range) and leaf.check.hi is not None and leaf.check.hi <= MAX_SECONDS, leaf.key
        timedelta(seconds=leaf.check.hi)
    with pytest.raises(OverflowError):
        timedelta(seconds=1e20)


# ------------------------------------------------------------------------------ megatron's scheduler
def _cfg(*overrides: str) -> Config:
    from launcher.config.compose import compose
    from launcher.config.schema import typed

    return typed(compose(["optim.lr=1e-3", "optim.min_lr=1e-4", "optim.lr_decay_style=linear", *overrides]))


def _scheduler(cfg: Config):
    from workers import cpu_shim

    cpu_shim.apply("cpu")  # megatron.core imports triton at import time
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from launcher.config.job_limits import scheduler_args

    return OptimizerParamScheduler(SimpleNamespace(param_groups=[{"params": []}]),
                                   **scheduler_args(cfg.optim, cfg.grpo.max_num_steps))


@pytest.mark.parametrize("overrides,refused", [
    ((), False),
    (("optim.lr_warmup_iters=39",), False),
    (("optim.lr_warmup_iters=40",), True),                      # grpo.max_num_steps=40: the decay steps
    (("optim.lr_warmup_iters=60",), True),
    (("optim.lr_warmup_iters=10", "optim.lr_decay_iters=10"), True),
    (("optim.lr_warmup_iters=10", "optim.lr_decay_iters=11"), False),
    (("optim.lr_decay_style=WSD",), True),
    (("optim.lr_decay_style=cosine",), False),
])
def test_the_schedule_megatron_builds_is_the_one_the_launcher_accepts(overrides, refused):
    from launcher.config.job_limits import schedule_errors

    cfg = _cfg(*overrides)
    try:
        _scheduler(cfg)
        built = True
    except AssertionError:
        built = False
    assert built is not refused
    assert bool(schedule_errors(cfg)) is refused


@pytest.mark.parametrize("overrides,changed", [
    ((), None),
    (("grpo.max_num_steps=60",), "grpo.max_num_steps"),         # the decay steps, with lr_decay_iters null
    (("grpo.max_num_steps=60", "optim.lr_decay_iters=40"), None),   # the schedule it was trained with
    (("optim.lr=2e-3",), "optim.lr"),
    (("optim.min_lr=0",), "optim.min_lr"),
    (("optim.lr_warmup_iters=2",), "optim.lr_warmup_iters"),
    (("optim.lr_decay_style=cosine",), "optim.lr_decay_style"),
    (("optim.weight_decay=0.1",), "optim.weight_decay"),
    (("grpo.max_num_steps=60", "optim.override_opt_param_scheduler=true"), None),
    (("optim.adam_beta1=0.5",), None),                           # not part of the schedule
])
def test_a_resume_megatron_continues_is_one_the_launcher_accepts(overrides, changed):
    """A checkpoint's scheduler state (the demo's optim at lr 1e-3, 40 steps, 4 taken) loaded into the
    scheduler another config builds: megatron's load_state_dict refuses exactly the changes
    job_limits.schedule_changes names."""
    from launcher.config.job_limits import schedule_changes

    saved_cfg = _cfg()
    saved = _scheduler(saved_cfg)
    saved.step(increment=4)
    cfg = _cfg(*overrides)
    try:
        _scheduler(cfg).load_state_dict(saved.state_dict())
        loaded = True
    except AssertionError:
        loaded = False
    found = schedule_changes(saved_cfg, cfg)
    assert loaded is (changed is None)
    assert [k for k, _, _ in found][:1] == ([] if changed is None else [changed])


# ------------------------------------------------------------------------------ vLLM (one subprocess)
VLLM_PROBE = r"""
import json, math, sys, types
import torch
from transformers import LlamaConfig
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.model import _get_and_verify_max_len
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

cases = json.loads(sys.argv[1])
out = {"temperature": [], "rope": [], "positions": []}
for t in cases["temperature"]:
    out["temperature"].append(SamplingParams(temperature=t).temperature == t)
with set_current_vllm_config(VllmConfig()):
    for theta, rope in cases["rope"]:
        try:
            r = get_rope(32, 4096, True, {"rope_theta": theta, **rope}, torch.float32)
            out["rope"].append(bool(torch.isfinite(r.cos_sin_cache).all()))
        except Exception:
            out["rope"].append(False)
for hf, max_len in cases["positions"]:
    try:  # the engine's start: the derivation, then the check of vllm.max_model_len against it
        config = LlamaConfig(**hf)
        arch = types.SimpleNamespace(derived_max_model_len_and_key=ModelArchConfigConvertorBase(
            config, config).derive_max_model_len_and_key())
        _get_and_verify_max_len(config, arch, None, max_len, False, None)
        out["positions"].append(True)
    except Exception:
        out["positions"].append(False)
import typing
from vllm.config.cache import MambaDType
from vllm.config.compilation import CUDAGraphMode
from vllm.config.kernel import MoEBackend
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.registry import AttentionBackendEnum
out["accepts"] = {"moe_backend": list(typing.get_args(MoEBackend)), "mamba_ssm_cache_dtype": list(
    typing.get_args(MambaDType)), "cudagraph_mode": [m.name for m in CUDAGraphMode],
    "attention_backend": [m.name for m in AttentionBackendEnum]}
import dataclasses
from vllm.config.compilation import CompilationConfig
graphs = CompilationConfig(**cases["engine"]["compilation_config"])  # as EngineArgs.__post_init__ builds it
out["engine"] = [sorted(set(cases["engine"]) - {f.name for f in dataclasses.fields(EngineArgs)}),
                 graphs.cudagraph_mode.name, graphs.cudagraph_capture_sizes, graphs.pass_config.fuse_allreduce_rms,
                 AttentionBackendEnum[cases["engine"]["attention_backend"]].name]
print(json.dumps(out))
"""

TEMPERATURES = [1e-6, 0.001, 0.0099, 0.01, 0.7, 1.0, 2.0]
YARN = {"rope_type": "yarn", "original_max_position_embeddings": 256}
LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
# (theta, rope, stricter): `stricter` marks values vLLM builds that the launcher refuses on purpose
# (transformers' own rule: a scaling factor below 1 shrinks the positions; mscale, which vLLM's plain
# YaRN ignores and megatron-core's YaRN computes with)
ROPES = [
    (10000.0, {**YARN, "factor": 4.0}, False),
    (10000.0, {**YARN, "factor": 1.0}, False),
    (10000.0, {**YARN, "factor": -2.0}, False),
    (10000.0, {**YARN, "factor": 4.0, "beta_fast": 0.0}, False),
    (10000.0, {**YARN, "factor": 4.0, "beta_slow": -1.0}, False),
    (10000.0, {**YARN, "factor": [4.0]}, False),
    (10000.0, {**YARN, "factor": 4.0, "mscale": "big"}, True),
    (10000.0, {**YARN, "factor": 0.5}, True),
    (10000.0, {**LLAMA3, "factor": 8.0}, False),
    (10000.0, {**LLAMA3, "factor": 8.0, "low_freq_factor": 0.0}, False),
    (0.0, {**YARN, "factor": 4.0}, False),
    (-10000.0, {**YARN, "factor": 4.0}, False),
]
# (config.json's length keys, vllm.max_model_len)
POSITIONS = [
    ({"max_position_embeddings": 1024}, 1024),
    ({"max_position_embeddings": 1024}, 1025),
    ({"max_position_embeddings": 4096, "model_max_length": 2048}, 2048),
    ({"max_position_embeddings": 4096, "model_max_length": 2048}, 3000),
    ({"max_position_embeddings": 2048, "seq_length": 1024}, 1500),
    ({"max_position_embeddings": 2048, "max_sequence_length": 4096}, 2048),
    ({"max_position_embeddings": 1024, "model_max_length": "2048"}, 512),   # a length key vLLM cannot compare
    ({"max_position_embeddings": 1024, "seq_len": [2048]}, 512),
]


@pytest.fixture(scope="module")
def vllm_says():
    from tests.unit.test_generator_executor import ULTRA_ENGINE

    cases = {"temperature": TEMPERATURES, "rope": [[theta, rope] for theta, rope, _ in ROPES],
             "positions": [[{**_hf(keys)}, n] for keys, n in POSITIONS], "engine": ULTRA_ENGINE}
    p = subprocess.run([sys.executable, "-c", VLLM_PROBE, json.dumps(cases)], capture_output=True, text=True,
                       cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _hf(keys: dict) -> dict:
    from tests.unit.test_hostile_inputs import TINY_LLAMA

    return {k: v for k, v in TINY_LLAMA.items() if k not in ("architectures", "dtype")} | keys


def test_the_temperature_floor_is_vllms(vllm_says):
    """vLLM raises a temperature under 0.01 to 0.01 (the trainer would divide by the one given): the
    schema's floor refuses exactly those."""
    from launcher.config.fields import leaves

    (leaf,) = [x for x in leaves(Config) if x.key == "grpo.temperature"]
    assert [leaf.check.error(t) is None for t in TEMPERATURES] == vllm_says["temperature"]


def test_the_rope_the_launcher_accepts_is_one_vllm_builds(vllm_says):
    from launcher.config import model_rules
    from launcher.config.schema import Model

    from launcher.config.fields import leaves

    (theta_range,) = [x.check for x in leaves(Config) if x.key == "model.rope_theta"]
    for (theta, rope, stricter), builds in zip(ROPES, vllm_says["rope"]):
        accepted = theta_range.error(theta) is None and not model_rules._rope(
            Model(family="llama", rope_theta=theta, rope_scaling=rope))
        assert accepted == (builds and not stricter), (theta, rope, builds)


def test_the_context_the_launcher_accepts_is_one_vllm_accepts(vllm_says, tmp_path):
    from launcher.config import job_limits
    from launcher.config.compose import compose
    from launcher.config.schema import typed

    for i, ((keys, n), accepted) in enumerate(zip(POSITIONS, vllm_says["positions"])):
        d = tmp_path / f"m{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**_hf(keys), "architectures": ["LlamaForCausalLM"]}))
        cfg = typed(compose([f"model.path={d}", f"grpo.max_total_sequence_length={n}"]))
        assert (not job_limits.positions(cfg)) == accepted, (keys, n)
    assert vllm_says["positions"] == [True, False, True, False, False, True, False, False]


def test_the_engine_settings_the_schema_accepts_are_the_installed_vllms(vllm_says):
    """topology.generation's engine settings (schema.GenerationRole) accept what vLLM's own types accept
    (KernelConfig.moe_backend, CacheConfig.mamba_ssm_cache_dtype, CUDAGraphMode, AttentionBackendEnum), and
    the reference topology's settings are EngineArgs' keywords, its compilation settings a CompilationConfig."""
    from launcher.config import schema
    from tests.unit.test_generator_executor import ULTRA_ENGINE

    assert vllm_says["accepts"] == {"moe_backend": list(schema.VLLM_MOE_BACKENDS),
                                    "mamba_ssm_cache_dtype": list(schema.VLLM_MAMBA_DTYPES),
                                    "cudagraph_mode": list(schema.VLLM_CUDAGRAPH_MODES),
                                    "attention_backend": list(schema.VLLM_ATTENTION_BACKENDS)}
    graphs = ULTRA_ENGINE["compilation_config"]
    assert vllm_says["engine"] == [[], graphs["cudagraph_mode"], graphs["cudagraph_capture_sizes"],
                                   graphs["pass_config"]["fuse_allreduce_rms"], ULTRA_ENGINE["attention_backend"]]
