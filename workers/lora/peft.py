"""HF PEFT adapter files from LoRA factors in HF layout (`workers.lora.layout.HfLoraGroup`).

`write_peft_adapter` writes `adapter_model.safetensors` + `adapter_config.json`, which
`peft.PeftModel.from_pretrained` and vLLM's `--lora-modules` load. Used by the offline exporter
(workers.lora.export) and by the generator's adapter refit (workers.refit.vllm_extension).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import save_file

from workers.lora.layout import HfLoraGroup


def peft_state_dict(groups: Iterable[HfLoraGroup]) -> dict[str, torch.Tensor]:
    """HF PEFT adapter tensors: base_model.model.<module>.lora_A.weight [r, in] / lora_B.weight [out, r].

    Own storage per tensor: A is shared by the modules of a fused linear and the Bs may be views
    of one fused B, and safetensors refuses to save tensors that share memory.
    """
    out = {}
    for g in groups:
        for module, b in zip(g.hf_modules, g.lora_b):
            out[f"base_model.model.{module}.lora_A.weight"] = g.lora_a.clone(memory_format=torch.contiguous_format)
            out[f"base_model.model.{module}.lora_B.weight"] = b.clone(memory_format=torch.contiguous_format)
    return out


def peft_adapter_config(groups: Iterable[HfLoraGroup], dim: int, alpha: float,
                        base_model_name_or_path: str | None = None,
                        exclude_modules: Iterable[str] = ()) -> dict[str, Any]:
    """adapter_config.json content. PEFT scales by lora_alpha / r, Megatron by alpha / dim: equal.

    target_modules are module names' last parts (PEFT and vLLM match them as suffixes);
    exclude_modules, where given, the base modules those would also wrap without the adapter
    holding them (PEFT would attach empty LoRA layers there: an adapter not attached fully)."""
    targets = sorted({m.rsplit(".", 1)[-1] for g in groups for m in g.hf_modules})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(dim), "lora_alpha": alpha,
              "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True,
              "base_model_name_or_path": base_model_name_or_path}
    if exclude_modules:
        config["exclude_modules"] = sorted(exclude_modules)
    return config


def write_peft_adapter(out_dir: str | Path, groups: list[HfLoraGroup], dim: int, alpha: float,
                       base_model_name_or_path: str | None = None, exclude_modules: Iterable[str] = ()) -> Path:
    """Write adapter_model.safetensors + adapter_config.json (what PeftModel and vLLM load)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(peft_state_dict(groups), str(out / "adapter_model.safetensors"))
    config = peft_adapter_config(groups, dim, alpha, base_model_name_or_path, exclude_modules)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out
