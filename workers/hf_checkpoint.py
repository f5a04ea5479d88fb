"""Reading a local HF checkpoint directory (`*.safetensors`, optionally sharded with an index).

`weight_shapes(dir)`       {name: shape} from the safetensors headers alone (8-byte length + JSON,
                           read and checked by launcher.config.bounded; no tensor is read)
`read_tensors(dir, names)` the named torch tensors; a name matches its other HF spelling too
                           (`workers.lora.layout.hf_name_candidates`: Nemotron-H's `backbone.`/`model.`)
`lora_targets_outside_experts(dir)`  an MoE checkpoint's linears outside its experts (vLLM's LoRA filter)
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from launcher.config import bounded
from workers.lora.layout import hf_name_candidates

INDEX = "model.safetensors.index.json"


def weight_shapes(model_dir: str | Path) -> dict[str, list[int]]:
    """{weight name: shape} of every tensor in the directory's *.safetensors files ({} if none)."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        shapes.update(weight_shapes_of_file(path))
    return shapes


def read_tensors(model_dir: str | Path, names: list[str]) -> dict:
    """{name: tensor} for `names`, read from the checkpoint's safetensors files; KeyError if one is missing."""
    root = Path(model_dir)
    index = root / INDEX
    if index.exists():
        file_of = bounded.model_json(index, "index", obj=True).get("weight_map")
        if not isinstance(file_of, dict) or not all(isinstance(v, str) for v in file_of.values()):
            raise bounded.FileError(index, "weight_map", "must map each tensor name to its shard file")
    else:
        file_of = {key: "model.safetensors" for key in weight_shapes_of_file(root / "model.safetensors")}
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name in names:
        stored = next((c for c in hf_name_candidates(name) if c in file_of), None)
        if stored is None:
            raise KeyError(f"{name} is not in the checkpoint {model_dir}")
        by_file.setdefault(file_of[stored], []).append((name, stored))
    out = {}
    for file, pairs in by_file.items():
        with safe_open(str(root / file), framework="pt") as f:
            for name, stored in pairs:
                out[name] = f.get_tensor(stored)
    return out


def weight_shapes_of_file(path: str | Path) -> dict[str, list[int]]:
    """{weight name: shape} from one safetensors file's header (every entry checked: a FileError,
    one line naming the file and the tensor, for a header that is not one)."""
    return {name: list(t.shape) for name, t in bounded.safetensors_header(path).tensors.items()}


def lora_targets_outside_experts(model_dir: str) -> list[str] | None:
    """For a checkpoint with MoE experts: the linears of its layers outside the experts (module
    suffixes, e.g. q_proj, o_proj, gate), vLLM's deployment-time LoRA filter; None without experts.

    vLLM wraps every LoRA-capable module when LoRA is enabled, MoE experts included, and its LoRA
    MoE layer runs Triton kernels (none on CPU) even when no adapter touches the experts. Our
    adapters never do (validation refuses LoRA on experts outside refit.mode=merged), so the
    experts stay plain vLLM MoE layers. Read from the checkpoint's names, not a table per family.
    The generator passes it to vLLM; the exporter's `vllm serve` hint names it."""
    shapes = weight_shapes(model_dir)
    if not any(".experts." in name for name in shapes):
        return None
    return sorted({name[:-len(".weight")].rsplit(".", 1)[-1] for name, shape in shapes.items()
                   if ".layers." in name and ".experts." not in name and name.endswith(".weight") and len(shape) == 2})
