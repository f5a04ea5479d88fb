"""The trainer of tests/gpu: one Megatron-Bridge LoRA rank of the tiny recipe on cuda:0 (NCCL group of
one), in this process, shared by the modules of this directory (megatron's parallel state is per
process). Skipped, test by test, without CUDA (tests.helpers.gpu_check)."""

from __future__ import annotations

import socket

import pytest

from tests.helpers.batches import padded_batch
from tests.helpers.gpu_check import DEVICE, HYBRID_NEEDS, LOSS, ON_CUDA, OPTIM, PEFT, RECIPE, free_port


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from workers import tiny_models

    return tiny_models.build(tmp_path_factory.mktemp("models") / RECIPE, RECIPE, seed=0)


@pytest.fixture(scope="session")
def trainer(model_dir):
    import importlib.util

    missing = [m for m in HYBRID_NEEDS if importlib.util.find_spec(m) is None]
    if ON_CUDA and RECIPE.startswith("tiny_nemotron") and missing:
        pytest.skip(f"{RECIPE} on cuda needs {', '.join(missing)} (Megatron's hybrid spec and Mamba kernels: "
                    f"docs/gpu.md)")
    try:
        import workers.trainer.actor as actor_mod
    except ModuleNotFoundError as e:  # a package this environment lacks
        pytest.fail(f"cannot import the trainer: {e} (install it into this environment)", pytrace=False)
    from workers.trainer.actor import MegatronTrainer
    from workers.trainer.config import TrainerConfig

    try:  # info() resolves this host's name; an offline node may not resolve it
        socket.gethostbyname(socket.gethostname())
    except OSError:
        actor_mod.node_address = lambda: ("127.0.0.1", free_port())
    cfg = TrainerConfig.from_sections(str(model_dir), parallel={"tensor_parallel": 1}, peft=PEFT, optim=OPTIM,
                                      loss=LOSS, device=DEVICE, dtype="bfloat16" if ON_CUDA else "float32",
                                      seed=7, max_num_steps=20)
    assert cfg.use_distributed_optimizer == ON_CUDA
    t = MegatronTrainer(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    yield t
    t.shutdown()


@pytest.fixture(scope="session")
def batch():
    return padded_batch(16, [(4, 16), (5, 10), (6, 13), (4, 8)])
