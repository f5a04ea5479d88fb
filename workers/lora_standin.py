"""A stand-in for the trainer's refit surface: an HF checkpoint plus random LoRA factors.

`LoraStandin` has what refit reads from a trainer (`export_merged()`, `adapter_state()`,
`lora_config()`, `rank`) and the actor methods the real trainer has (`refit_payload`), without
Megatron: the refit tests and benchmark measure the refit path, not a training step, and start
in seconds. Factors are in Megatron layout (fused linear_qkv rows per query group, gated
linear_fc1 = [gate; up]); `step()` changes them like an optimizer step would.

`export_merged()` follows Megatron-Bridge's merged export independently of `workers.lora_layout`
(the code under test): its own HF names, Bridge's `split_qkv_weights` and `torch.chunk` for the
rows of B, and the Bridge's own `_merge_single_adapter_weight` for the arithmetic. So a
`merged_delta` refit that matches it bitwise matches the Bridge, not merely itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

ATTENTION = ("linear_qkv", "linear_proj")
ALL_LINEAR = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class LoraStandin:
    def __init__(self, model_dir: str, targets=ALL_LINEAR, dim: int = 8, alpha: float = 16,
                 seed: int = 0, lora_std: float = 0.1, dtype: str = "float32"):
        import json

        from safetensors.torch import load_file

        self.model_dir = str(model_dir)
        self.rank = 0
        self.dim, self.alpha, self.targets = dim, alpha, tuple(targets)
        self.dtype = getattr(torch, dtype)
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        if cfg["model_type"] not in ("llama", "qwen2"):
            raise ValueError("the stand-in knows llama/qwen2 names only")
        self.hf_config = cfg
        self.heads, self.groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim, self.hidden = cfg.get("head_dim") or cfg["hidden_size"] // self.heads, cfg["hidden_size"]
        self.ffn, self.layers = cfg["intermediate_size"], cfg["num_hidden_layers"]
        self.base = {k: v.to(self.dtype) for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}
        self.generator = torch.Generator().manual_seed(seed)
        self.lora_std = lora_std
        self.factors = {}  # megatron module -> [A, B]
        shapes = {"linear_qkv": ((self.heads + 2 * self.groups) * self.head_dim, self.hidden),
                  "linear_proj": (self.hidden, self.heads * self.head_dim),
                  "linear_fc1": (2 * self.ffn, self.hidden), "linear_fc2": (self.hidden, self.ffn)}
        for layer in range(self.layers):
            for target in self.targets:
                out_features, in_features = shapes[target]
                a = torch.randn(dim, in_features, generator=self.generator) / in_features ** 0.5
                b = torch.randn(out_features, dim, generator=self.generator) * lora_std
                self.factors[self._module(layer, target)] = [a.to(self.dtype), b.to(self.dtype)]
        self.steps = 0

    @staticmethod
    def _module(layer: int, target: str) -> str:
        sub = "self_attention" if target in ATTENTION else "mlp"
        return f"decoder.layers.{layer}.{sub}.{target}"

    def step(self, scale: float = 0.5) -> int:
        """Move every factor, as a training step would (B mostly: it starts at zero in real LoRA)."""
        for a, b in self.factors.values():
            b.add_(torch.randn(b.shape, generator=self.generator).to(self.dtype) * self.lora_std * scale)
            a.add_(torch.randn(a.shape, generator=self.generator).to(self.dtype) * 0.01)
        self.steps += 1
        return self.steps

    # ------------------------------------------------------------------ the trainer's refit surface
    def lora_config(self) -> dict:
        return {"dim": self.dim, "alpha": self.alpha, "target_modules": list(self.targets),
                "family": self.hf_config["model_type"], "num_attention_heads": self.heads,
                "num_query_groups": self.groups, "head_dim": self.head_dim, "hidden_size": self.hidden}

    def adapter_state(self) -> dict:
        out = {}
        for module, (a, b) in self.factors.items():
            out[f"{module}.adapter.linear_in.weight"] = a.float().clone()
            out[f"{module}.adapter.linear_out.weight"] = b.float().clone()
        return out

    def export_merged(self) -> Iterator[tuple[str, torch.Tensor]]:
        merged = self._merged_modules()
        for name, tensor in self.base.items():
            yield name, merged.get(name, tensor)

    def merged_state(self) -> dict[str, torch.Tensor]:
        return dict(self.export_merged())

    def refit_payload(self, mode: str, bucket_mb: float):
        from workers import refit

        return refit.trainer_payload(self, mode, bucket_mb)

    def open_refit_group(self, host: str, port: int, world_size: int, backend: str = "gloo") -> None:
        from workers import refit

        refit.open_sender_group(host, port, world_size, backend)

    def close_refit_group(self) -> None:
        from workers import refit

        refit.close_sender_group()

    # ------------------------------------------------------------------ Bridge's merge, independently
    def _merged_modules(self) -> dict[str, torch.Tensor]:
        from workers import cpu_shim

        cpu_shim.apply("cpu")
        from types import SimpleNamespace

        from megatron.bridge.models.conversion.param_mapping import split_qkv_weights
        from megatron.bridge.models.conversion.peft_bridge import MegatronPeftBridge

        cfg = SimpleNamespace(num_attention_heads=self.heads, num_query_groups=self.groups,
                              kv_channels=self.head_dim, hidden_size=self.hidden)
        merge = MegatronPeftBridge._merge_single_adapter_weight
        out = {}
        for module, (a, b) in self.factors.items():
            layer = int(module.split(".")[2])
            target = module.rsplit(".", 1)[-1]
            prefix = f"model.layers.{layer}"
            if target == "linear_qkv":
                parts = zip(("q_proj", "k_proj", "v_proj"), split_qkv_weights(cfg, b, feature_dim=b.shape[1]))
                names = {f"{prefix}.self_attn.{p}.weight": bp for p, bp in parts}
            elif target == "linear_fc1":
                gate, up = torch.chunk(b, 2, dim=0)
                names = {f"{prefix}.mlp.gate_proj.weight": gate, f"{prefix}.mlp.up_proj.weight": up}
            elif target == "linear_proj":
                names = {f"{prefix}.self_attn.o_proj.weight": b}
            else:
                names = {f"{prefix}.mlp.down_proj.weight": b}
            for name, b_part in names.items():
                out[name] = merge(None, self.base[name], self.alpha, self.dim, a, b_part)
        return out
