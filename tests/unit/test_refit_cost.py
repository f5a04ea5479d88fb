"""The dry run's refit estimate (launcher.refit_cost): bytes per refit mode and seconds at
topology.interconnect_gb_s, against a hand computation for the reference recipe."""

from __future__ import annotations

import pytest

from launcher import memory, refit_cost
from launcher.__main__ import main
from launcher.config.compose import compose
from launcher.config.schema import typed

# Nemotron 3 Ultra as conf/model/nemotron3_ultra.yaml states it: 561e9 parameters, bf16; LoRA dim 16 on
# linear_qkv and linear_proj of every one of its 88 layers (model.size.attention_layers is not set)
HIDDEN, Q, KV, LAYERS, R = 8192, 32 * 128, 8 * 128, 88, 16
MERGED_BYTES = 561e9 * 2
LORA_BYTES = LAYERS * R * ((HIDDEN + Q + 2 * KV) + (Q + HIDDEN)) * 4   # A + Bs of qkv, A + B of proj, float32


def costs(*overrides):
    cfg = typed(compose(list(overrides)))
    return {c.mode: c for c in refit_cost.refit_costs(cfg, memory.model_size(cfg))}


def test_the_reference_recipe_by_hand():
    c = costs("topology=ultra_6n4g")
    assert LORA_BYTES == 149_946_368
    assert c["merged"].bytes == MERGED_BYTES and c["merged"].seconds == pytest.approx(MERGED_BYTES / 900e9)
    assert c["merged"].seconds == pytest.approx(1.2467, abs=1e-4)
    for mode in ("merged_delta", "adapter"):
        assert c[mode].bytes == LORA_BYTES and c[mode].seconds == pytest.approx(LORA_BYTES / 900e9)


def test_the_link_and_the_dtype_change_the_numbers():
    c = costs("topology=ultra_6n4g", "topology.interconnect_gb_s=50", "model.dtype=float32", "peft.dim=32")
    assert c["merged"].bytes == 561e9 * 4 and c["merged"].seconds == pytest.approx(561e9 * 4 / 50e9)   # 44.9 s
    assert c["adapter"].bytes == 2 * LORA_BYTES   # factors travel in float32 whatever the model's dtype


def test_full_fine_tuning_has_only_the_merged_mode():
    assert list(costs("topology=ultra_6n4g", "peft=none")) == ["merged"]


def test_the_dry_run_prints_each_mode_next_to_the_upstream_measurement(capsys):
    assert main(["topology=ultra_6n4g", "dry_run=true", "refit.mode=merged_delta"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("refit per step at 900 GB/s"):].split("\n\n")[0].splitlines()
    assert block[1].split() == ["merged", "1.12", "TB", "1.25", "s"]
    assert block[2].split() == ["merged_delta", "150", "MB", "0.167", "ms", "<-", "refit.mode"]
    assert block[3].split()[0] == "adapter"
    assert "9.9 s per merged refit of Nemotron 3 Ultra on 6 GB200 nodes" in block[4]


def test_nothing_on_cpu(capsys):
    assert main(["dry_run=true"]) == 0
    assert "refit per step" not in capsys.readouterr().out
