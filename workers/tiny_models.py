"""Tiny HF models and tokenizers built locally with random weights (there is no model hub here).

Used by the embedded default run, the tests and the benchmarks. A recipe is a plain dict of
architecture numbers (`launcher.config.schema.BUILTIN_MODELS`, the values of `model.builtin`);
`build(out_dir, recipe)` writes a normal HF checkpoint directory (config.json, model.safetensors
in float32, tokenizer files) that transformers, vLLM and Megatron-Bridge all load like any
downloaded model.

Head sizes stay in {32, 64, ...}: vLLM's CPU attention supports only a fixed set of head sizes.
The tokenizer is word-level over a fixed vocabulary (numbers 0-199, arithmetic words, letters),
so a prompt such as "What is 12 + 25 ? Give only the answer ." tokenizes to whole words and the
tiny model can be rewarded for producing a particular word.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from launcher.config.schema import BUILTIN_COMMON, BUILTIN_MODELS, CHAT_RECIPES

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = (
    [str(i) for i in range(200)]
    + ["what", "is", "+", "-", "=", "?", ".", ",", ":", "give", "only", "the", "answer", "say",
       "repeat", "word", "number", "yes", "no", "plus", "minus", "equals", "and", "a", "an", "of"]
    + [chr(c) for c in range(ord("a"), ord("z") + 1) if chr(c) != "a"]
)

# chat=True: ChatML markers and roles, and a ChatML chat template (like Qwen's instruct tokenizers)
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(chat: bool = False):
    """A word-level fast tokenizer over WORDS (no training, deterministic, no hub)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS + (CHAT_TOKENS if chat else []))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation("isolated")])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    if not chat:
        return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                    eos_token="</s>", unk_token="<unk>")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="<|im_end|>", unk_token="<unk>",
                                                additional_special_tokens=CHAT_TOKENS[:2])
    fast.chat_template = CHATML
    return fast


def _hf_config(recipe: dict, vocab_size: int, tokenizer):
    r = dict(recipe)
    family = r.pop("family")
    r.pop("vocab_size", None)
    common = dict(vocab_size=vocab_size, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, **BUILTIN_COMMON)
    rope = common.pop("rope_theta")  # Nemotron-H has no rotary embedding
    if family in ("llama", "qwen2"):
        cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
        return cls(rms_norm_eps=1e-6, rope_theta=rope, **common, **r)
    if family == "qwen3":
        return transformers.Qwen3Config(rms_norm_eps=1e-6, rope_theta=rope, **common, **r)
    if family == "qwen3_moe":  # every layer sparse (decoder_sparse_step 1); the recipe says norm_topk_prob
        return transformers.Qwen3MoeConfig(rms_norm_eps=1e-6, rope_theta=rope,
                                           decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                                           router_aux_loss_coef=0.001, **common, **r)
    if family == "nemotron_h":  # the recipe names its layer pattern, Mamba sizes and experts
        return transformers.NemotronHConfig(layer_norm_epsilon=1e-5, **common, **r)
    raise ValueError(f"unknown model family {family!r}")


def build(out_dir: str | Path, recipe: str = "tiny_llama", seed: int = 0, init_std: float = 0.08,
          chat: bool = False, spec: dict | None = None) -> Path:
    """Write a random-weight HF checkpoint + tokenizer for `recipe` into out_dir; return it.

    `spec`: architecture numbers in place of the recipe's (same keys; tests build fixtures so).
    Idempotent: an existing complete directory built from the same recipe and seed is reused.
    Written into a temporary sibling and renamed, so concurrent builders never see half a model,
    and one that finds it built meanwhile by another keeps that one (which a reader may be using).
    """
    spec = dict(spec or BUILTIN_MODELS[recipe])
    chat = chat or recipe in CHAT_RECIPES
    stamp = {"recipe": recipe, "seed": seed, "init_std": init_std, "spec": spec}
    if chat:
        stamp["chat"] = True  # a ChatML tokenizer (make_tokenizer(chat=True))
    tokenizer = make_tokenizer(chat)
    vocab_size = max(spec.get("vocab_size", 0), len(tokenizer))
    return _write(Path(out_dir), stamp, lambda: _hf_config(spec, vocab_size, tokenizer), tokenizer, seed, init_std)


def build_from_config(out_dir: str | Path, config: dict, seed: int = 0, init_std: float = 0.08) -> Path:
    """A random-weight checkpoint whose config.json is `config` as given (a published model's keys,
    e.g. `rope_scaling` and `rope_theta` as the Hub's files spell them), with this module's
    tokenizer: vocab_size and the special token ids are set to the tokenizer's. Idempotent."""
    tokenizer = make_tokenizer()
    config = {**config, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    stamp = {"config": config, "seed": seed, "init_std": init_std}

    def hf_config():
        kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
        return transformers.AutoConfig.for_model(config["model_type"], **kwargs)

    return _write(Path(out_dir), stamp, hf_config, tokenizer, seed, init_std, config_json=config)


def _write(out: Path, stamp: dict, hf_config, tokenizer, seed: int, init_std: float,
           config_json: dict | None = None) -> Path:
    transformers.utils.logging.disable_progress_bar()
    if _built(out, stamp):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    cfg = hf_config()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, init_std)  # larger than HF's default so greedy output is not degenerate
            elif "norm" in name and "weight" in name:
                p.uniform_(0.8, 1.2)  # non-trivial norms expose a wrong weight mapping
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            elif name.endswith("A_log"):  # Mamba decay rates exp(A_log) in [1, 8], one per head
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 8.0)))
            elif name.endswith(".D"):  # Mamba skip connection, one per head
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # Nemotron-H router's expert bias (a buffer)
                b.normal_(0.0, 0.05)
    model.eval().save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if config_json is not None:  # the file as the publisher wrote it, not as this transformers re-serialises it
        dtype = {k: "float32" for k in ("torch_dtype", "dtype") if k in config_json} or {"torch_dtype": "float32"}
        (tmp / "config.json").write_text(json.dumps({**config_json, **dtype}, indent=2))
    if getattr(cfg, "model_type", None) == "nemotron_h" and getattr(cfg, "num_nextn_predict_layers", 0):
        _add_mtp_layers(tmp, cfg, init_std)
    (tmp / "tiny_model.json").write_text(json.dumps(stamp, indent=1))
    if _built(out, stamp):  # by another process meanwhile (it may be reading it): keep that one
        shutil.rmtree(tmp)
        return out
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def mtp_tensors(cfg, init_std: float) -> dict[str, torch.Tensor]:
    """A Nemotron-H's MTP layers, random, in the names the published checkpoints use (and Megatron-Bridge's
    NemotronHBridge maps, vLLM's NemotronHMTP loads); transformers 5 builds no MTP layers, so this writes
    them. Each of the `num_nextn_predict_layers` steps is one layer per symbol of
    `mtp_hybrid_override_pattern`, numbered on (`mtp.layers.<step * len(pattern) + j>.`), each a backbone
    block of that kind (`norm`, `mixer.*`; experts one tensor each); a step's first layer also holds `enorm`
    and `hnorm` (the norms of the token's embedding and of the previous hidden state) and `eh_proj`
    ([hidden, 2 * hidden]: their concatenation back to the hidden width), its last `final_layernorm`."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

    pattern, depth, hidden = cfg.mtp_hybrid_override_pattern, cfg.num_nextn_predict_layers, cfg.hidden_size
    blocks = transformers.NemotronHConfig(**{**cfg.to_dict(), "layers_block_type": cfg.mtp_layers_block_type * depth,
                                             "num_nextn_predict_layers": 0})
    out: dict[str, torch.Tensor] = {}
    for i in range(depth * len(pattern)):
        prefix = f"mtp.layers.{i}."
        block = NemotronHBlock(blocks, layer_idx=i)
        tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}
        if i % len(pattern) == 0:
            tensors.update({"enorm.weight": torch.empty(hidden), "hnorm.weight": torch.empty(hidden),
                            "eh_proj.weight": torch.empty(hidden, 2 * hidden)})
        if i % len(pattern) == len(pattern) - 1:
            tensors["final_layernorm.weight"] = torch.empty(hidden)
        for name, t in tensors.items():
            t = _random_like(name, t.detach().clone().float(), init_std)
            if name.startswith("mixer.experts."):   # fused [experts, out, in] in memory, one tensor per expert on disk
                part = name.rsplit(".", 1)[1]
                out.update({f"{prefix}mixer.experts.{e}.{part}.weight": t[e].contiguous() for e in range(len(t))})
            else:
                out[prefix + name] = t.contiguous()
    return out


def _random_like(name: str, t: torch.Tensor, init_std: float) -> torch.Tensor:
    """What `_write` draws for a weight of this name (MTP layers: the same kinds of weights)."""
    if t.dim() >= 2:
        return t.normal_(0.0, init_std)
    if "norm" in name and name.endswith("weight"):
        return t.uniform_(0.8, 1.2)
    if name.endswith("e_score_correction_bias"):
        return t.normal_(0.0, 0.05)
    if name.endswith("bias"):
        return t.normal_(0.0, 0.05)
    return t


def _add_mtp_layers(directory: Path, cfg, init_std: float) -> None:
    """Write `mtp_tensors` into the checkpoint's model.safetensors, and the MTP pattern into config.json in the
    published spelling (mtp_hybrid_override_pattern, beside transformers' mtp_layers_block_type)."""
    from safetensors.torch import load_file, save_file

    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{directory}: MTP layers are written into one model.safetensors (a tiny model's)")
    save_file({**load_file(weights), **mtp_tensors(cfg, init_std)}, weights, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["mtp_hybrid_override_pattern"] = cfg.mtp_hybrid_override_pattern
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def _built(out: Path, stamp: dict) -> bool:
    try:
        return json.loads((out / "tiny_model.json").read_text()) == stamp
    except (OSError, ValueError):
        return False


def main(argv=None):
    p = argparse.ArgumentParser(description="Build a tiny random-weight HF model + tokenizer locally.")
    p.add_argument("out_dir")
    p.add_argument("--recipe", default="tiny_llama", choices=sorted(BUILTIN_MODELS))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(build(a.out_dir, a.recipe, a.seed))


if __name__ == "__main__":
    main()
