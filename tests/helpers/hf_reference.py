"""HF transformers as the reference the integration tests compare with: a checkpoint's model (on its
own weights, on weights a trainer exported, with a PEFT adapter), its logprob of each next token
aligned as the trainer's, greedy decoding one full forward per token, and the max-abs comparison.

    model = hf_reference.load(model_dir, merged, files_in=tmp_path)   # HF file names (an export)
    assert_close(hf_reference.token_logprobs(model, ids), group.logprobs(batch), "merged vs trainer")
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def load(model_dir, state: dict | None = None, *, files_in: Path | None = None, adapter_dir=None):
    """transformers' float32 model of model_dir, in eval mode.

    `state` replaces the checkpoint's weights. With `files_in` (a directory) its names are the files'
    (backbone.*, one tensor per expert: what an export writes, which transformers converts to its
    modules only when loading files): they are written there as a checkpoint beside model_dir's
    other files. Without, they are the model's own module names, loaded in place (every key known;
    only non-persistent rotary buffers may be absent). `adapter_dir`: a PEFT adapter attached on top."""
    import transformers

    if state is not None and files_in is not None:
        from safetensors.torch import save_file

        files_in = Path(files_in)
        files_in.mkdir(parents=True, exist_ok=True)
        for f in Path(model_dir).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".index.json"):
                shutil.copy(f, files_in / f.name)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(files_in / "model.safetensors"),
                  metadata={"format": "pt"})
        model_dir, state = files_in, None
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if state is not None:
        missing, unexpected = model.load_state_dict(dict(state), strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return model.eval()


@torch.no_grad()
def token_logprobs(model, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) of each next token, aligned like the trainer's (column 0 is 0)."""
    logp = torch.log_softmax(model(input_ids).logits.float() / temperature, dim=-1)
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    out[:, 1:] = logp[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    return out


@torch.no_grad()
def greedy(model, prompts: list[list[int]], n_new: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens of each prompt and the log-softmax logprob of each, one full forward per token."""
    out = []
    for p in prompts:
        ids, toks, lps = list(p), [], []
        for _ in range(n_new):
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            tok = int(logprobs.argmax())
            toks.append(tok)
            lps.append(float(logprobs[tok]))
            ids.append(tok)
        out.append((toks, lps))
    return out


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 1e-5) -> None:
    """Max abs difference at most atol (1e-5: float32 through different kernels)."""
    err = (a - b).abs().max().item()
    assert err <= atol, f"{what}: max abs diff {err:.3e} > {atol:.0e}"
