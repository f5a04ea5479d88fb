"""`vllm serve --enable-lora` with an adapter from `python -m launcher.export` (real vLLM, CPU, float32).

One server for the module (start-up is the slow part, ~30-60 s and ~3 GB), started with the
exporter's own `vllm serve` hint through tests/helpers/vllm_server.py (the project's entry point
`python -m workers.generator.serve`, float32, max_model_len 256). The adapter comes from a real TrainerGroup run saved at TP=2 (shared with
test_export through lora_runs). /v1/models must list base and adapter (adapter's parent = base); a
greedy completion with the adapter must equal PeftModel's greedy tokens and differ from the base's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_runs import trained_run
from tests.helpers import hf_reference as hf
from tests.helpers.vllm_server import get, post, serve_args, vllm_server

pytestmark = pytest.mark.integration
NAME = "grpo-lora"
NEW_TOKENS = 12
PROMPTS = ["what is 12 + 25 ? give only the answer .", "say the number 7 and repeat the word yes"]


def _tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (vLLM runs an engine core + a worker)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


@pytest.fixture(scope="module")
def server(local_ray, tiny_model, tmp_path_factory):
    from launcher import export

    run = trained_run(tmp_path_factory.getbasetemp() / "lora-runs", tiny_model("tiny_llama"), "tiny_llama", 2)
    adapter = tmp_path_factory.mktemp("served-adapter")
    report = export.export(run.checkpoint, adapter, name=NAME)
    base = str(run.model_dir.resolve())
    log_path = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    # what the exporter tells the user to run, with this machine's test options
    with vllm_server(serve_args(report.serve_command()), log_path) as (url, pid, startup_s):
        rss = _tree_rss_mib(pid)
        print(f"\nvllm serve ready in {startup_s:.1f} s, RSS {rss:.0f} MiB (server + engine processes)")
        yield {"url": url, "base": base, "adapter": adapter, "run": run, "startup_s": startup_s, "rss_mib": rss}


def test_models_lists_base_and_adapter_with_parent(server):
    models = {m["id"]: m for m in get(f"{server['url']}/v1/models")["data"]}
    assert set(models) == {server["base"], NAME}
    assert models[NAME]["parent"] == server["base"]
    assert models[NAME]["root"] == str(server["adapter"])
    assert models[server["base"]]["parent"] is None


def test_greedy_completion_with_adapter_equals_peft_and_differs_from_base(server):
    import peft
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(server["base"])
    base = transformers.AutoModelForCausalLM.from_pretrained(server["base"], dtype=torch.float32).eval()
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    base_tokens = [t for t, _ in hf.greedy(base, prompts, NEW_TOKENS)]
    peft_model = peft.PeftModel.from_pretrained(base, str(server["adapter"])).eval()
    peft_tokens = [t for t, _ in hf.greedy(peft_model, prompts, NEW_TOKENS)]

    def served(model: str) -> list[list[int]]:
        out = []
        for p in prompts:
            r = post(f"{server['url']}/v1/completions",
                      {"model": model, "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0.0,
                       "ignore_eos": True, "return_token_ids": True})
            out.append(r["choices"][0]["token_ids"])
        return out

    with_adapter, without = served(NAME), served(server["base"])
    assert with_adapter == peft_tokens
    assert without == base_tokens
    assert with_adapter != without
