"""The user's prompt files: every bad input is one line naming the key and the file (exit 2 before
anything is written), good files of each format load as Arrow and serve in a resumable order,
prompts go through a real ChatML template, too-long prompts are skipped and counted."""

from __future__ import annotations

import json

import pytest

from launcher.__main__ import main
from launcher.config.compose import compose
from launcher.config.schema import ConfigError, Data, typed
from launcher.config.validate import validate
from launcher.driver import data


def errors(*overrides: str) -> list[str]:
    return [str(e) for e in validate(typed(compose(list(overrides))), submitting=True)]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def files(tmp_path):
    good = write_jsonl(tmp_path / "q.jsonl", [{"question": f"say {i} .", "solution": str(i)} for i in range(5)])
    holes = write_jsonl(tmp_path / "holes.jsonl", [{"question": "a", "solution": "1"}, {"question": "b", "solution": "2"},
                                                   {"solution": "3"}])
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "broken.jsonl").write_text('{"question": "a"}\n{"question": \n')
    (tmp_path / "q.txt").write_text("hello\n")
    (tmp_path / "q.csv").write_text("question,solution\nsay 1 .,1\n,2\n")
    write_jsonl(tmp_path / "m.jsonl", [{"messages": "say 1 .", "answer": "1"}])    # a string, not messages
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": {"text": "say 1 ."}, "answer": "1"}])   # an object, not text
    return {"good": good, "holes": holes, "dir": tmp_path}


@pytest.mark.parametrize("overrides, message", [
    (["data.train={dir}/nope.jsonl"], "data.train: {dir}/nope.jsonl: no such file"),
    (["data.train={dir}/q.txt"], "data.train: {dir}/q.txt: unknown format '.txt'; allowed: .jsonl, .json, .parquet, "
                                 ".csv or a built-in set (say_number, math_add, guess_number, guess_number_val)"),
    (["data.train={dir}/q.jsonl"], "data.prompt_key: {dir}/q.jsonl has no field 'prompt'; its fields: question, "
                                   "solution"),
    (["data.train={dir}/q.jsonl", "data.prompt_key=question"],
     "data.answer_key: {dir}/q.jsonl has no field 'answer'; its fields: question, solution"),
    (["data.train={dir}/holes.jsonl", "data.prompt_key=question", "data.answer_key=solution"],
     "data.prompt_key: line 3 of {dir}/holes.jsonl has no 'question'"),
    (["data.train={dir}/q.csv", "data.prompt_key=question", "data.answer_key=solution"],
     "data.prompt_key: row 2 of {dir}/q.csv has no 'question'"),
    (["data.train={dir}/empty.jsonl"], "data.train: {dir}/empty.jsonl holds no records"),
    (["data.train={dir}/q.jsonl", "data.prompt_key=question", "data.messages_key=msgs", "reward.fn=exact_match",
      "data.answer_key=solution"],
     "data.messages_key: {dir}/q.jsonl has no field 'msgs'; its fields: question, solution"),
    (["data.train=say_number", "data.validation={dir}/q.jsonl", "grpo.val_period=2"],
     "data.prompt_key: {dir}/q.jsonl has no field 'prompt'; its fields: question, solution"),
    (["data.train={dir}/m.jsonl", "data.messages_key=messages", "reward.fn=exact_match"],
     "data.messages_key: {dir}/m.jsonl: field 'messages' holds string, not a list of messages ({{\"role\": ..., "
     "\"content\": ...}})"),
    (["data.train={dir}/p.jsonl", "reward.fn=exact_match"],
     "data.prompt_key: {dir}/p.jsonl: field 'prompt' holds struct<text: string>, not text (a prompt is a string)"),
    (["grpo.val_period=2"], "grpo.val_period: validation needs data.validation=PATH (or a built-in set)"),
    (["data.chat_template=yes"], "data.chat_template: must be auto or none, got 'yes'"),
    (["data.max_prompt_tokens=600"], "data.max_prompt_tokens: must be at most max_total_sequence_length - "
                                     "max_new_tokens = 504, got 600"),
    (["grpo.dynamic_sampling.enabled=true", "grpo.dynamic_sampling.max_gen_batches=0"],
     "grpo.dynamic_sampling.max_gen_batches: must be at least 1, got 0"),
    (["grpo.top_p=0.9"], "grpo.top_p: must be 1.0, got 0.9: the trainer's logprobs do not apply vLLM's top-p "
                         "truncation, so the gradient would be biased (lower grpo.temperature to sharpen sampling)"),
    (["grpo.overlong_penalty.buffer_tokens=9"],
     "grpo.overlong_penalty.buffer_tokens: must be in [1, max_new_tokens = 8] or null, got 9"),
])
def test_bad_data_is_one_line(files, overrides, message):
    d = files["dir"]
    assert errors(*[o.format(dir=d) for o in overrides]) == [message.format(dir=d)]


def test_unreadable_file_names_it(files):
    (err,) = errors(f"data.train={files['dir']}/broken.jsonl", "data.prompt_key=question", "reward.fn=exact_match")
    assert err.startswith(f"data.train: cannot read {files['dir']}/broken.jsonl as json: ") and "\n" not in err


def test_an_unreadable_file_is_the_only_line_on_stderr(files, tmp_path, capfd):
    """HF datasets logs its own 'Failed to load JSON' line for a cut file: ours is the one line."""
    broken = files["dir"] / "broken.jsonl"
    assert main([f"run.root={tmp_path / 'runs'}", f"data.train={broken}", "data.prompt_key=question",
                 "reward.fn=exact_match"]) == 2
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith(f"error: data.train: cannot read {broken} as json: "), line


def test_a_user_reward_needs_no_answer_field(files, tmp_path):
    reward = tmp_path / "r.py"
    reward.write_text("def score(response, example):\n    return float(example['question'] in response)\n")
    assert errors(f"data.train={files['good']}", "data.prompt_key=question", f"reward.fn={reward}:score") == []


def test_cli_exit_2_and_nothing_written(files, tmp_path, capsys):
    root = tmp_path / "runs"
    assert main([f"run.root={root}", f"data.train={files['good']}"]) == 2
    assert capsys.readouterr().err == (f"error: data.prompt_key: {files['good']} has no field 'prompt'; its fields: "
                                       f"question, solution\n")
    assert not root.exists()


def test_a_dry_run_does_not_need_the_file(tmp_path, capsys):
    assert main(["dry_run=true", f"data.train={tmp_path}/elsewhere.jsonl"]) == 0


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_every_format_serves_the_same_records_in_a_resumable_order(tmp_path, fmt):
    import pandas as pd

    rows = [{"question": f"say {i} .", "solution": str(i)} for i in range(37)]
    path = tmp_path / f"q.{fmt}"
    frame = pd.DataFrame(rows)
    {"jsonl": lambda: frame.to_json(path, orient="records", lines=True),
     "json": lambda: path.write_text(json.dumps(rows)),
     "parquet": lambda: frame.to_parquet(path), "csv": lambda: frame.to_csv(path, index=False)}[fmt]()
    d = Data(train=str(path), prompt_key="question", answer_key="solution", seed=5)
    a, b = data.PromptDataset(str(path), 5, d), data.PromptDataset(str(path), 5, d)
    straight, end, _ = a.take(0, 100)
    resumed = b.take(0, 41)[0] + b.take(41, 59)[0]
    assert end == 100 and [e.index for e in straight] == [e.index for e in resumed]
    assert sorted(e.index for e in straight[:37]) == list(range(37))
    ex = straight[0]
    as_text = {k: str(v) for k, v in ex.record.items()}  # csv infers types: "16" reads as 16
    assert as_text == rows[ex.index] and ex.prompt == rows[ex.index]["question"]
    assert str(ex.target) == rows[ex.index]["solution"] and ex.where.endswith(f"of {path}")


def chat_tokenizer():
    from workers.tiny_models import make_tokenizer

    return make_tokenizer(chat=True)


def test_chat_template_gives_token_ids_not_batchencoding_keys():
    tok = chat_tokenizer()
    enc = data.PromptEncoder(tok, Data(system_prompt="say only numbers ."))
    ids = enc.encode(data.Example(0, {}, prompt="say 40 and 49 ."))
    assert all(isinstance(i, int) for i in ids)
    assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "system", "say", "only", "<unk>", ".", "<|im_end|>",
                                              "<|im_start|>", "user", "say", "40", "and", "49", ".", "<|im_end|>",
                                              "<|im_start|>", "assistant"]
    msgs = [{"role": "user", "content": "what is 2 + 3 ?"}]
    own = data.PromptEncoder(tok, Data(messages_key="msgs")).encode(data.Example(0, {}, messages=msgs))
    assert tok.convert_ids_to_tokens(own)[:3] == ["<|im_start|>", "user", "what"]
    plain = data.PromptEncoder(tok, Data(chat_template="none")).encode(data.Example(0, {}, prompt="say 40 ."))
    assert tok.convert_ids_to_tokens(plain) == ["say", "40", "."]


def test_messages_without_a_template_is_one_line():
    from workers.tiny_models import make_tokenizer

    with pytest.raises(ConfigError) as e:
        data.PromptEncoder(make_tokenizer(), Data(messages_key="msgs"))
    assert str(e.value) == ("data.messages_key: needs a tokenizer with a chat template (and data.chat_template=auto); "
                            "this tokenizer has none: use data.prompt_key")


def test_too_long_prompts_are_skipped_counted_and_the_order_stays_resumable(tmp_path):
    rows = [{"prompt": " ".join(["1"] * (1 + i % 4)), "answer": "1"} for i in range(20)]  # 1..4 tokens
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    d = Data(train=path, chat_template="none")
    enc = data.PromptEncoder(chat_tokenizer(), d)
    prompts = data.Prompts(data.PromptDataset(path, 0, d), enc, max_tokens=2)
    examples, ids, after, skipped = prompts.take(0, 6)
    assert all(len(t) <= 2 for t in ids) and len(examples) == 6
    assert after == 6 + skipped and skipped > 0
    again = data.Prompts(data.PromptDataset(path, 0, d), enc, 2)
    first, _, mid, _ = again.take(0, 2)
    rest, _, end, _ = again.take(mid, 4)
    assert [e.index for e in first + rest] == [e.index for e in examples] and end == after
    with pytest.raises(ConfigError, match=r"data.max_prompt_tokens: every prompt of .*p.jsonl is longer than"):
        data.Prompts(data.PromptDataset(path, 0, Data(train=path, max_prompt_tokens=0)), enc, 0).take(0, 1)
