"""A lossless tokenizer built locally, shaped as Qwen2.5's is: byte-level BPE (here with no merges: one
token per byte), `<|endoftext|>` / `<|im_start|>` / `<|im_end|>` special, `<tool_call>` / `</tool_call>`
added tokens, `<|im_end|>` the end of a turn, and a chat template given by the caller (e.g. the published
Qwen2.5 template, tests/fixtures/qwen2_5_chat_template.jinja). Any text round-trips, so what a model
"replies" reads back exactly as written (tool calls included)."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>"]


def qwen_template() -> str:
    """Qwen2.5-0.5B-Instruct's chat template as published (the fixture's source: tests/unit/test_tool_calls.py)."""
    return (FIXTURES / "qwen2_5_chat_template.jinja").read_text()


def make(chat_template: str | None = None):
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = chat_template if chat_template is not None else qwen_template()
    return fast
