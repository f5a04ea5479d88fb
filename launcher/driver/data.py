"""Prompt sets: the built-in demos or the user's file, read once into Arrow; prompts encoded with
the tokenizer's chat template.

`data.train` is a built-in name (`say_number`, `math_add`) or a .jsonl/.json/.parquet/.csv file
read with HF `datasets`' local loaders (memory-mapped Arrow, cached beside HF's other datasets; no
Python object per row: a record becomes a dict only when it is served).

The order in which prompts are served is a pure function of (seed, epoch, position): a resumed
run that knows its position serves exactly the prompts an uninterrupted run would have served
next. No iterator state to save. Prompts longer than `data.max_prompt_tokens` are skipped when
met (the position still advances over them) and counted.

- `say_number` (the embedded demo): "say numbers between 40 and 49 ." rewarded with the fraction
  of the answer's words that are numbers in the range. A random tiny model rarely does this
  (about 4% of its vocabulary qualifies); LoRA on attention learns it in a few minutes on CPU.
- `math_add` (for real models): "what is 12 + 25 ? give only the answer ." rewarded 1 when the
  first number in the answer is the sum (the reference's smoke prompt, with random operands).
- `guess_number`: records {low, high, secret} for the multi-turn demo (env=guess_number,
  launcher.driver.envs.guess_number): no prompt field, the environment writes the first message;
  `guess_number_val`: games of other ranges, its validation set (grpo.val_period=N runs them greedily).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from launcher.config.schema import ConfigError, Data

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _say_number(seed: int) -> list[dict]:
    return [{"prompt": f"say numbers between {lo} and {lo + 9} .", "answer": [lo, lo + 9]} for lo in (10, 40, 70, 100)]


def _math_add(seed: int, n: int = 256) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append({"prompt": f"what is {a} + {b} ? give only the answer .", "answer": a + b})
    return out


def _guess_number(seed: int) -> list[dict]:
    return [{"low": lo, "high": lo + 9, "secret": lo + k} for lo in (10, 40, 70, 100) for k in range(10)]


def _guess_number_val(seed: int) -> list[dict]:
    """Games the training records do not hold (other ranges), for greedy validation episodes."""
    return [{"low": lo, "high": lo + 9, "secret": lo + k} for lo in (20, 55, 85) for k in (1, 4, 8)]


BUILTIN = {"say_number": _say_number, "math_add": _math_add, "guess_number": _guess_number,
           "guess_number_val": _guess_number_val}


@dataclass(frozen=True)
class Example:
    index: int                 # row number in the set (0-based)
    record: dict               # every field of the record
    prompt: str | None = None
    messages: list | None = None
    target: Any = None         # record[data.answer_key] when present
    where: str = field(default="", compare=False)  # "line 12 of train.jsonl", for messages


def is_file_source(source: str) -> bool:
    return source not in BUILTIN


def where(source: str, row: int) -> str:
    if not is_file_source(source):
        return f"record {row} of {source}"
    unit = "line" if Path(source).suffix == ".jsonl" else "row"
    return f"{unit} {row + 1} of {source}"


def read(source: str, key: str, seed: int = 0):
    """The records of `source` as a `datasets.Dataset` (Arrow); ConfigError naming `key` if unreadable."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own 'Failed to load' line: ours is the one line
    if not is_file_source(source):
        return datasets.Dataset.from_list(BUILTIN[source](seed))
    path = Path(source)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(key, f"{source}: unknown format {path.suffix or '(no extension)'!r}; allowed: "
                               f"{', '.join(FORMATS)} or a built-in set ({', '.join(BUILTIN)})")
    if not path.is_file():
        raise ConfigError(key, f"{source}: no such file")
    if path.stat().st_size == 0:
        raise ConfigError(key, f"{source} holds no records")
    try:
        ds = datasets.load_dataset(fmt, data_files=str(path.resolve()), split="train")
    except Exception as e:  # noqa: BLE001 - any parse error is the same user-facing problem
        cause = e.__cause__ or e.__context__ or e
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ConfigError(key, f"cannot read {source} as {fmt}: {text[:300]}") from None
    if len(ds) == 0:
        raise ConfigError(key, f"{source} holds no records")
    return ds


def check_fields(ds, source: str, key: str, d: Data, need_answer: bool, need_prompt: bool = True) -> None:
    """Every record has the prompt (or messages) field (unless an environment makes the prompts),
    and the answer field when the reward needs it."""
    import pyarrow.compute as pc

    prompt_key = "data.messages_key" if d.messages_key else "data.prompt_key"
    needed = ([(prompt_key, d.messages_key or d.prompt_key)] if need_prompt else []) + (
        [("data.answer_key", d.answer_key)] if need_answer else [])
    names = ds.column_names
    for k, name in needed:
        if name not in names:
            raise ConfigError(k, f"{source} has no field {name!r}; its fields: {', '.join(names)}")
        column = ds.data.column(name)  # the Arrow column: no Python objects
        if column.null_count:
            first = pc.index(pc.is_null(column), True).as_py()
            raise ConfigError(k, f"{where(source, first)} has no {name!r}")
        wrong = _wrong_type(column.type, messages=k == "data.messages_key") if k != "data.answer_key" else None
        if wrong:
            raise ConfigError(k, f"{source}: field {name!r} holds {column.type}, {wrong}")


def _wrong_type(t, messages: bool) -> str | None:
    """What is wrong with the Arrow type of the prompt (text) or messages column (a list of
    {role, content} texts), or None: the tokenizer gets these, in the job."""
    import pyarrow as pa

    text = (pa.types.is_string, pa.types.is_large_string)
    if not messages:  # a number is encoded as its text; a list or an object would be its repr
        plain = (*text, pa.types.is_integer, pa.types.is_floating)
        return None if any(f(t) for f in plain) else "not text (a prompt is a string)"
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return "not a list of messages ({\"role\": ..., \"content\": ...})"
    fields = {t.value_type.field(i).name: t.value_type.field(i).type for i in range(t.value_type.num_fields)}
    if not all(k in fields and any(f(fields[k]) for f in text) for k in ("role", "content")):
        return "not a list of messages with text role and content"
    return None


def check(d: Data, need_answer: bool, submitting: bool, need_prompt: bool = True) -> list[ConfigError]:
    """The data section's values; the files are read when they exist (always when submitting)."""
    errs = []  # chat_template: its set is the schema's (launcher.config.schema.Data)
    for key, source in (("data.train", d.train), ("data.validation", d.validation)):
        if source is None or not is_file_source(source):
            continue  # the built-in sets have every field
        if is_file_source(source) and Path(source).suffix.lower() not in FORMATS:
            errs.append(ConfigError(key, f"{source}: unknown format {Path(source).suffix or '(no extension)'!r}; "
                                         f"allowed: {', '.join(FORMATS)} or a built-in set ({', '.join(BUILTIN)})"))
            continue
        if is_file_source(source) and not submitting and not Path(source).exists():
            continue  # a dry run may plan for a filesystem this machine does not see
        try:
            check_fields(read(source, key, d.seed), source, key, d, need_answer, need_prompt)
        except ConfigError as e:
            errs.append(e)
    return errs


class PromptDataset:
    """Records served in a per-epoch shuffled order derived from (seed, epoch)."""

    def __init__(self, source: str, seed: int, d: Data | None = None, key: str = "data.train"):
        self.source, self.seed = source, seed
        self.d = d or Data(train=source, seed=seed)
        self.table = read(source, key, seed)
        self._order: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return len(self.table)

    def order(self, epoch: int):
        """The permutation of epoch `epoch` (the last one is kept: one epoch is served at a time)."""
        if self._order is None or self._order[0] != epoch:
            import numpy as np

            idx = list(range(len(self)))
            random.Random(f"{Path(self.source).name if is_file_source(self.source) else self.source}:"
                          f"{self.seed}:{epoch}").shuffle(idx)
            self._order = (epoch, np.asarray(idx, dtype=np.int64))
        return self._order[1]

    def example(self, row: int) -> Example:
        rec = self.table[int(row)]
        d = self.d
        return Example(int(row), rec, prompt=rec.get(d.prompt_key), messages=rec.get(d.messages_key) if d.messages_key
                       else None, target=rec.get(d.answer_key), where=where(self.source, int(row)))

    def take(self, position: int, n: int, keep: Callable[[Example], bool] | None = None
             ) -> tuple[list[Example], int, int]:
        """(n examples served from global `position`, the position after them, how many were skipped).

        `keep(example)` False skips an example (too long); a whole epoch of skips is an error."""
        out, run_of_skips = [], 0
        p = position
        while len(out) < n:
            epoch, k = divmod(p, len(self))
            ex = self.example(self.order(epoch)[k])
            p += 1
            if keep is None or keep(ex):
                out.append(ex)
                run_of_skips = 0
            else:
                run_of_skips += 1
                if run_of_skips >= len(self):
                    raise ConfigError("data.max_prompt_tokens", f"every prompt of {self.source} is longer than "
                                                                f"{self.d.max_prompt_tokens} tokens")
        return out, p, p - position - n

    def head(self, n: int | None) -> list[Example]:
        """The first n records in file order (validation)."""
        return [self.example(i) for i in range(len(self) if n is None else min(n, len(self)))]


def conversation(prompt, messages, d: Data) -> list[dict]:
    """A record's conversation: its own messages (data.messages_key) or [user: its prompt], after
    data.system_prompt when it has no system message."""
    msgs = list(messages) if messages is not None else [{"role": "user", "content": prompt}]
    if d.system_prompt and not any(m.get("role") == "system" for m in msgs):
        msgs = [{"role": "system", "content": d.system_prompt}] + msgs
    return msgs


class PromptEncoder:
    """[system?, user] messages (or the record's own) through the chat template, as token ids."""

    def __init__(self, tokenizer, d: Data):
        self.tokenizer, self.d = tokenizer, d
        self.template = d.chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))
        if d.messages_key and not self.template:
            raise ConfigError("data.messages_key", "needs a tokenizer with a chat template (and data.chat_template="
                                                   "auto); this tokenizer has none: use data.prompt_key")

    def messages(self, ex: Example) -> list[dict]:
        return conversation(ex.prompt, ex.messages, self.d)

    def encode(self, ex: Example) -> list[int]:
        if self.template:
            out = self.tokenizer.apply_chat_template(self.messages(ex), add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)
            return list(out["input_ids"])  # transformers 5 returns a BatchEncoding: list() of it is its keys
        text = str(ex.prompt) if not self.d.system_prompt else f"{self.d.system_prompt}\n{ex.prompt}"
        return list(self.tokenizer(text)["input_ids"])


class Prompts:
    """A PromptDataset served as encoded prompts of at most `max_tokens` tokens (longer ones skipped).
    `encode` False (env.fn: an environment writes each episode's first messages): the records
    only, each with no token ids."""

    def __init__(self, dataset: PromptDataset, encoder: PromptEncoder, max_tokens: int, encode: bool = True):
        self.dataset, self.encoder, self.max_tokens, self.encode = dataset, encoder, max_tokens, encode

    def take(self, position: int, n: int) -> tuple[list[Example], list[list[int]], int, int]:
        """(examples, their token ids, the position after them, how many too-long prompts were skipped)."""
        ids: dict[int, list[int]] = {}

        def keep(ex: Example) -> bool:
            ids[ex.index] = self.encoder.encode(ex) if self.encode else []
            return len(ids[ex.index]) <= self.max_tokens

        examples, after, skipped = self.dataset.take(position, n, keep)
        return examples, [ids[e.index] for e in examples], after, skipped

    def all(self, limit: int | None) -> tuple[list[Example], list[list[int]], int]:
        """The first `limit` records in file order that fit (validation): (examples, ids, skipped)."""
        kept, ids = [], []
        head = self.dataset.head(limit)
        for ex in head:
            t = self.encoder.encode(ex) if self.encode else []
            if len(t) <= self.max_tokens:
                kept.append(ex)
                ids.append(t)
        if not kept:
            raise ConfigError("data.max_prompt_tokens", f"every prompt of {self.dataset.source} is longer than "
                                                        f"{self.max_tokens} tokens")
        return kept, ids, len(head) - len(kept)


def max_prompt_tokens(d: Data, max_total: int, max_new: int) -> int:
    return d.max_prompt_tokens if d.max_prompt_tokens is not None else max_total - max_new


def absolute_sources(cfg) -> None:
    """In the config saved at submission: data files and reward, environment and tool files as
    absolute paths (the job's working directory is not the user's)."""
    from launcher.driver.rewards import file_part
    from launcher.paths import absolute

    for key in ("train", "validation"):
        source = getattr(cfg.data, key)
        if source is not None and is_file_source(source):
            setattr(cfg.data, key, str(absolute(source)))
    def spec(value: str | None) -> str | None:
        src = file_part(value) if value else None
        return f"{absolute(src)}:{value.rpartition(':')[2]}" if src is not None else value

    cfg.reward.fn, cfg.env.fn = spec(cfg.reward.fn), spec(cfg.env.fn)
    cfg.env.tools = [spec(t) for t in cfg.env.tools]
