"""A run on a user's own data, as the README's "Train on your own data" shows: a JSONL whose fields
are not called prompt/answer, a reward function in a file, a tokenizer with a ChatML chat
template, greedy validation every few steps, DAPO dynamic sampling and overlong shaping; a
reward that raises on one record; resume from a checkpoint equal to the uninterrupted run."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import deterministic, launch, rows, trainer_tensors

pytestmark = pytest.mark.e2e
PY = sys.executable
STEPS = 12

REWARD = '''
def in_range(response, example):
    """Share of the response's words that are numbers in the record's range."""
    if example.get("explode"):
        raise RuntimeError("this record's reward is broken")
    lo, hi = example["range"]
    words = response.split()
    hits = sum(1 for w in words if w.isdigit() and lo <= int(w) <= hi)
    return hits / len(words) if words else 0.0
'''


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    from workers import tiny_models

    d = tmp_path_factory.mktemp("user")
    model = tiny_models.build(d / "chat_model", "tiny_llama", chat=True)
    train = [{"instruction": f"say numbers between {lo} and {lo + 9} .", "range": [lo, lo + 9], "id": i}
             for i, lo in enumerate((10, 40, 70, 100))]
    train.append({"instruction": "say numbers between 150 and 159 .", "range": [150, 159], "id": 4, "explode": True})
    val = [{"instruction": f"say numbers between {lo} and {lo + 9} .", "range": [lo, lo + 9], "id": 10 + i}
           for i, lo in enumerate((10, 40, 70, 100))]
    (d / "my_reward.py").write_text(REWARD)
    return {"model": model, "train": write_jsonl(d / "train.jsonl", train), "val": write_jsonl(d / "val.jsonl", val),
            "reward": d / "my_reward.py"}


def user_run(f: dict, root: Path, *extra: str) -> subprocess.CompletedProcess:
    """The user's run, named mine, under root: to its end, its exit code 0."""
    return launch(root, "run.name=mine", f"model.path={f['model']}",
                  f"data.train={f['train']}", f"data.validation={f['val']}", "data.prompt_key=instruction",
                  f"reward.fn={f['reward']}:in_range", "grpo.val_period=4", "grpo.val_at_start=true",
                  "grpo.dynamic_sampling.enabled=true", "grpo.dynamic_sampling.max_gen_batches=2",
                  "grpo.overlong_penalty.enabled=true", "grpo.overlong_penalty.buffer_tokens=2",
                  "grpo.overlong_penalty.max_penalty=0.1", f"grpo.max_num_steps={STEPS}",
                  "checkpointing.save_period=4", "checkpointing.keep_top_k=null", "logging.tensorboard=false", *extra)


@pytest.fixture(scope="module")
def straight(user_files, tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    p = user_run(user_files, root)
    return root / "mine", p


def test_own_data_chat_template_file_reward_learns_with_validation(straight, user_files):
    run, p = straight
    r = rows(run)
    assert [x["step"] for x in r] == list(range(1, STEPS + 1))
    for x in r:
        assert x["train/gen_kl_error"] < 1e-5, x  # float32: vLLM and Megatron agree on every token
        assert 1 <= x["dynamic_sampling/gen_batches"] <= 2 and 0 <= x["dynamic_sampling/kept_groups"] <= 8
        assert 0.0 <= x["response/truncated_fraction"] <= 1.0 and x["data/dropped_prompts"] == 0
    val = [(0, r[0]["val/reward_at_start"])] + [(x["step"], x["val/reward"]) for x in r if "val/reward" in x]
    assert [s for s, _ in val] == [0, 4, 8, 12]
    assert all(math.isfinite(v) for _, v in val)
    assert val[-1][1] > val[0][1] + 0.15, val  # the run learns: greedy validation reward rises (0 -> 0.25)
    assert "through the tokenizer's chat template" in p.stdout and "validation: 4 records from" in p.stdout
    assert "validation reward (first -> last)" in (run / "summary.txt").read_text()
    assert (run / "reward" / "my_reward.py").read_text() == REWARD  # the run loads its own copy


def test_a_reward_that_raises_on_some_records_is_counted_and_the_run_finishes(straight):
    run, p = straight
    r = rows(run)
    errors = sum(x["reward/errors"] for x in r)
    assert errors > 0 and errors % 8 == 0  # 8 samples of the exploding record each time it is served
    assert "finished at step 12/12" in p.stdout
    log = (run / "logs" / "reward_errors.log").read_text()
    assert "RuntimeError: this record's reward is broken" in log and "line 5 of" in log and "Traceback" in log


def test_resume_with_dynamic_sampling_and_validation_equals_the_uninterrupted_run(straight, user_files, tmp_path):
    run_a, _ = straight
    run_b = tmp_path / "mine"
    shutil.copytree(run_a, run_b, ignore=shutil.ignore_patterns("step_12", "ray", "submitit"))
    p = user_run(user_files, tmp_path, "+resume=step_8")
    info = json.loads((run_a / "checkpoints" / "step_8" / "training_info.json").read_text())
    assert f"(step 8, {info['consumed_prompts']} prompts consumed" in p.stdout
    assert info["consumed_prompts"] >= 8 * 8  # dynamic sampling advanced the position by whole rounds
    # refit/* differ at step 9 only: the resumed run pushes its weights there (its engines start from the
    # base model) while the uninterrupted one had pushed the same weights after step 8, for validation
    same = lambda x: {k: v for k, v in deterministic(x).items() if not k.startswith("refit/")}  # noqa: E731
    assert [same(x) for x in rows(run_b)] == [same(x) for x in rows(run_a)]
    assert rows(run_b)[8]["refit/bytes"] > 0 and rows(run_a)[8]["refit/bytes"] == 0
    a, b = trainer_tensors(run_a / "checkpoints" / "step_12"), trainer_tensors(run_b / "checkpoints" / "step_12")
    assert sorted(a) == sorted(b) and any(".adapter." in k for k in a)
    for k in a:
        assert a[k].equal(b[k]), k  # bitwise


def test_messages_need_a_chat_template_one_line(user_files, tmp_path):
    """A tokenizer without a chat template cannot render a record's messages: the job would refuse it
    at start, so the submission does (launcher.config.job_limits), one line, exit 2, nothing started."""
    msgs = write_jsonl(tmp_path / "chats.jsonl", [{"msgs": [{"role": "user", "content": "say 4 ."}], "answer": "4"}])
    p = subprocess.run([PY, "-m", "launcher", f"run.root={tmp_path}", f"data.train={msgs}", "data.messages_key=msgs",
                        "reward.fn=exact_match", "grpo.max_num_steps=1", "logging.tensorboard=false"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stderr == ("error: data.messages_key: needs the tokenizer's chat template to encode the messages, and "
                        "the built-in model tiny_llama has none (model=tiny_llama_chat has one); use data.prompt_key\n")
    assert not (tmp_path / "local-tiny_llama").exists()
