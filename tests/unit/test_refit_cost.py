"""The dry run's refit estimate (launcher.refit_cost): bytes per refit mode and seconds at
topology.interconnect_gb_s, against a hand computation for the reference recipe."""

from __future__ import annotations

import pytest

from launcher import memory, refit_cost
from launcher.__main__ import main
from launcher.config.compose import compose
from launcher.config.schema import typed

# Nemotron 3 Ultra as conf/model/nemotron3_ultra.yaml states it (its published config.json): 561e9 parameters
# in bf16 with its one MTP step, which no refit sends; LoRA dim 16 on linear_qkv and linear_proj of each of its
# 12 attention layers (64 heads of 128 over 2 KV groups)
HIDDEN, Q, KV, LAYERS, R = 8192, 64 * 128, 2 * 128, 12, 16
EXPERTS, EXPERT_FF, LATENT, SHARED_FF = 512, 5120, 2048, 10240
MTP_ATTENTION = HIDDEN * (Q + 2 * KV) + Q * HIDDEN + HIDDEN                    # qkv, proj, norm
MTP_MOE = (EXPERTS * 2 * LATENT * EXPERT_FF + 2 * HIDDEN * SHARED_FF           # routed experts (in the latent width),
           + EXPERTS * HIDDEN + EXPERTS + 2 * HIDDEN * LATENT + HIDDEN)        # the shared one, router + bias, latent
MTP_STEP = MTP_ATTENTION + MTP_MOE + HIDDEN * 2 * HIDDEN + 3 * HIDDEN          # projections, norm; eh_proj, 3 norms
MERGED_BYTES = (561e9 - MTP_STEP) * 2
LORA_BYTES = LAYERS * R * ((HIDDEN + Q + 2 * KV) + (Q + HIDDEN)) * 4   # A + Bs of qkv, A + B of proj, float32


def costs(*overrides):
    cfg = typed(compose(list(overrides)))
    return {c.mode: c for c in refit_cost.refit_costs(cfg, memory.model_size(cfg))}


def test_the_reference_recipe_by_hand():
    c = costs("topology=ultra_6n4g")
    assert (MTP_STEP, LORA_BYTES) == (11_215_610_368, 25_559_040)
    assert c["merged"].bytes == MERGED_BYTES and c["merged"].seconds == pytest.approx(MERGED_BYTES / 900e9)
    assert c["merged"].seconds == pytest.approx(1.2217, abs=1e-4)
    for mode in ("merged_delta", "adapter"):
        assert c[mode].bytes == LORA_BYTES and c[mode].seconds == pytest.approx(LORA_BYTES / 900e9)


def test_the_link_and_the_dtype_change_the_numbers():
    c = costs("topology=ultra_6n4g", "topology.interconnect_gb_s=50", "model.dtype=float32", "peft.dim=32")
    assert c["merged"].bytes == MERGED_BYTES * 2 and c["merged"].seconds == pytest.approx(MERGED_BYTES * 2 / 50e9)
    assert c["adapter"].bytes == 2 * LORA_BYTES   # factors travel in float32 whatever the model's dtype


def test_full_fine_tuning_has_only_the_merged_mode():
    assert list(costs("topology=ultra_6n4g", "peft=none")) == ["merged"]


def test_the_dry_run_prints_each_mode_next_to_the_upstream_measurement(capsys):
    assert main(["topology=ultra_6n4g", "dry_run=true", "refit.mode=merged_delta"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("refit per step at 900 GB/s"):].split("\n\n")[0].splitlines()
    assert block[1].split() == ["merged", "1.1", "TB", "1.22", "s"]
    assert block[2].split() == ["merged_delta", "25.6", "MB", "0.0284", "ms", "<-", "refit.mode"]
    assert block[3].split()[0] == "adapter"
    assert "9.9 s per merged refit of Nemotron 3 Ultra on 6 GB200 nodes" in block[4]


def test_nothing_on_cpu(capsys):
    assert main(["dry_run=true"]) == 0
    assert "refit per step" not in capsys.readouterr().out
