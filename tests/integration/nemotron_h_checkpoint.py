"""Write a Nemotron-H LoRA trainer checkpoint (`save_state`'s layout) without building the model.

Why: the exporter's name handling (base checkpoints with `backbone.` and with `model.` names) is
checked against factors written by hand, independent of the trainer, in seconds (a real trained
Nemotron-H adapter is exported in tests/integration/test_nemotron_h.py). What a real hybrid model's
`save_state` holds, and so what this writes with megatron-core dist_checkpointing (torch_dist):
  - one entry per layer: megatron-core's HybridStack keys its layers `decoder.layers.<N>.` (the GPT
    stack instead stacks layers on a leading axis), so `decoder.layers.<N>.<linear>.adapter.linear_in.weight`
    (A, [r, in]) and `...linear_out.weight` (B, [out, r]), global shapes;
  - fused linear_qkv B rows in Megatron's order: per query group [its q heads | k | v] (written out by
    hand below, not with the code under test); relu2 MLP: linear_fc1 is up_proj alone (no gate);
  - optimizer state (`optimizer.state.exp_avg.<key>`, `exp_avg_sq`), scheduler + trainer info in the
    common state, `rng_state`: the entries the exporter must skip.
Which Megatron linears exist in which layer, and their shapes, come from Megatron-Bridge's NemotronH
mapping registry (which HF weights a linear covers) and the base checkpoint (whether those weights
exist in layer N, and their [out, in]). Written by one rank (TP=1): the stored global tensors are the
same at any TP size.

usage: python nemotron_h_checkpoint.py MODEL_DIR OUT_DIR FACTORS_PT
FACTORS_PT receives {"model.layers.N.mixer.<proj>": (A, B)}: what the exported adapter must hold.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

RANK, ALPHA = 8, 16
TARGETS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def base_shapes(model_dir: Path) -> dict[str, list[int]]:
    shapes = {}
    for path in model_dir.glob("*.safetensors"):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            shapes.update({k: v["shape"] for k, v in json.loads(f.read(size)).items() if k != "__metadata__"})
    return shapes


def lora_tensors(model_dir: Path):
    """({DCP key: tensor}, {HF module: (A, B)}) for LoRA on every registry-mapped linear of the base."""
    import torch
    from megatron.bridge.models.nemotronh.nemotron_h_bridge import NemotronHBridge

    registry = NemotronHBridge().mapping_registry()
    cfg = json.loads((model_dir / "config.json").read_text())
    groups, head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
    per_group = cfg["num_attention_heads"] // groups
    shapes = base_shapes(model_dir)
    gen = torch.Generator().manual_seed(0)
    tensors, factors = {}, {}
    num_layers = 1 + max(int(n.split(".")[2]) for n in shapes if n.startswith("backbone.layers."))
    for layer in range(num_layers):
        for target in TARGETS:
            module = f"decoder.layers.{layer}.{target}"
            hf = registry.megatron_to_hf_lookup(f"{module}.weight").hf_param
            hf_names = [hf["q"], hf["k"], hf["v"]] if isinstance(hf, dict) else [hf]
            if not all(n in shapes for n in hf_names):
                continue  # this layer is another kind (Mamba, MLP or attention)
            a = 0.1 * torch.randn(RANK, shapes[hf_names[0]][1], generator=gen)
            bs = [0.1 * torch.randn(shapes[n][0], RANK, generator=gen) for n in hf_names]
            if len(bs) == 3:
                q, k, v = bs
                fused = torch.cat([q.reshape(groups, per_group * head_dim, RANK), k.reshape(groups, head_dim, RANK),
                                   v.reshape(groups, head_dim, RANK)], dim=1).reshape(-1, RANK)
            else:
                (fused,) = bs
            tensors[f"{module}.adapter.linear_in.weight"] = a
            tensors[f"{module}.adapter.linear_out.weight"] = fused
            for name, b in zip(hf_names, bs):
                factors["model." + name[len("backbone."):-len(".weight")]] = (a, b)
    return tensors, factors


def main(model_dir: str, out_dir: str, factors_path: str) -> None:
    from workers import cpu_shim

    cpu_shim.apply("cpu")
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    tensors, factors = lora_tensors(Path(model_dir))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}
        optimizer = {"state": {i: {m: ShardedTensor.from_rank_offsets(f"optimizer.state.{m}.{k}", torch.rand_like(t),
                                                                       replica_id=0)
                                   for m in ("exp_avg", "exp_avg_sq")}
                               for i, (k, t) in enumerate(tensors.items())},
                     "param_groups": [{"lr": 5e-3, "params": list(range(len(tensors)))}]}
        state = {"model": model, "optimizer": optimizer,
                 "scheduler": {"max_lr": 5e-3, "min_lr": 5e-3, "num_steps": 3, "lr_decay_style": "constant"},
                 "trainer": {"step": 3, "layout": {"world_size": 1, "tensor_parallel": 1},
                             "peft": {"enabled": True, "dim": RANK, "alpha": ALPHA, "target_modules": list(TARGETS)},
                             "has_optimizer_state": True},
                 "rng_state": ShardedObject("rng_state", {"torch": torch.get_rng_state()}, (1,), (0,), replica_id=0)}
        os.makedirs(out_dir, exist_ok=True)
        with cpu_shim.cuda_factories_on_cpu("cpu"):
            dist_checkpointing.save(state, out_dir)
    finally:
        torch.distributed.destroy_process_group()
    torch.save(factors, factors_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
