"""DAPO dynamic sampling as the step collects it (launcher.driver.rollout.collect): which prompt
groups the batch holds, how many rounds were sampled and where the data position ends up.

The generator is a stand-in that answers by script (vLLM is not the subject here); the prompts are
the real data.Prompts over a JSONL file and the tiny tokenizer, the config is the composed default
with the overrides a user would give, and the scores come from the built-in exact_match called in
this process (the reward pool is tested in test_rewards.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from launcher.config.compose import compose
from launcher.config.schema import typed
from launcher.driver import advantages, data, rewards
from launcher.driver.rollout import collect, request_seed


@dataclass
class Out:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class ScriptedGenerators:
    """Answers sample j of the prompt at served position p with SCRIPT[p][j] = (text, tokens)."""

    def __init__(self, script: dict[int, list[tuple[str, int]]], encoded: dict[tuple, int], n: int):
        self.script, self.encoded, self.n, self.calls = script, encoded, n, []

    def generate(self, prompts, temperature, top_p, max_tokens, seeds):
        self.calls.append(seeds)
        outs = []
        for i, ids in enumerate(prompts):
            text, length = self.script[self.encoded[tuple(ids)]][i % self.n]
            outs.append(Out(text, list(range(length)), [-0.5] * length, "length" if length >= max_tokens else "stop"))
        return outs


class InProcessRewards:
    def score(self, texts, examples):
        return [rewards.exact_match(t, ex.target) for t, ex in zip(texts, examples)], 0


RIGHT, WRONG = "right", "wrong"
N = 3  # generations per prompt


def setup(tmp_path, script_by_position, *overrides):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {i} .", "answer": RIGHT}) + "\n" for i in range(12)))
    cfg = typed(compose([f"data.train={path}", "data.chat_template=none", "grpo.dynamic_sampling.enabled=true",
                         "grpo.overlong_penalty.enabled=true", "grpo.num_prompts_per_step=2",
                         f"grpo.num_generations_per_prompt={N}", "grpo.max_new_tokens=8", *overrides]))
    from workers.tiny_models import make_tokenizer

    dataset = data.PromptDataset(cfg.data.train, cfg.data.seed, cfg.data)  # as the GRPO loop builds it
    encoder = data.PromptEncoder(make_tokenizer(), cfg.data)
    prompts = data.Prompts(dataset, encoder, 64)
    served = [dataset.example(dataset.order(0)[p]) for p in range(8)]  # the records at served positions 0..7
    encoded = {tuple(encoder.encode(ex)): p for p, ex in enumerate(served)}
    assert len(encoded) == 8  # every prompt tells its record apart
    gens = ScriptedGenerators(script_by_position, encoded, N)
    return cfg, prompts, gens, served


def held(batch, gens) -> list[int]:
    """The served positions of the batch's prompt groups, in batch order."""
    return [gens.encoded[tuple(batch.prompt_ids[i])] for i in range(0, len(batch.prompt_ids), N)]


# max_new_tokens 8, overlong buffer 8 // 4 = 2: penalty 0 up to 6 tokens, -0.5 at 7, -1 at 8
ALL_WRONG_LENGTHS_DIFFER = [(WRONG, 6), (WRONG, 7), (WRONG, 8)]   # shaped -1, -1.5, -2: scores all 0
ALL_RIGHT = [(RIGHT, 3)] * 3
MIXED = [(RIGHT, 3), (WRONG, 4), (RIGHT, 5)]
MIXED_2 = [(WRONG, 2), (RIGHT, 2), (WRONG, 8)]


def run(tmp_path, script, *overrides, position=0, step=1):
    cfg, prompts, gens, served = setup(tmp_path, script, *overrides)
    batch, after, m = collect(cfg, gens, prompts, InProcessRewards(), step, position)
    return batch, after, m, held(batch, gens), gens, cfg


def test_an_uninformative_round_is_dropped_and_the_next_fills_the_batch(tmp_path):
    # round 1 (positions 0, 1): wrong answers differing only in the overlong penalty, all right answers;
    # round 2 (positions 2, 3): both mixed
    script = {0: ALL_WRONG_LENGTHS_DIFFER, 1: ALL_RIGHT, 2: MIXED, 3: MIXED_2}
    batch, after, m, groups, gens, cfg = run(tmp_path, script)
    assert groups == [2, 3]
    assert batch.rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert [len(r) for r in batch.response_ids] == [3, 4, 5, 2, 2, 8]
    assert after == 4
    assert m["dynamic_sampling/gen_batches"] == 2 and m["dynamic_sampling/kept_groups"] == 2
    assert m["dynamic_sampling/generated_samples"] == 12
    # round 2 numbers its prompts from num_prompts_per_step: its requests are seeded apart from round 1's
    assert gens.calls[1] == [request_seed(cfg.run.seed, 1, p, j) for p in (2, 3) for j in range(N)]


def test_a_short_batch_is_topped_up_with_the_first_dropped_group(tmp_path):
    script = {0: ALL_WRONG_LENGTHS_DIFFER, 1: ALL_RIGHT, 2: MIXED, 3: ALL_RIGHT}
    batch, after, m, groups, _, _ = run(tmp_path, script, "grpo.dynamic_sampling.max_gen_batches=2")
    assert groups == [2, 0]
    assert after == 4
    assert m["dynamic_sampling/gen_batches"] == 2 and m["dynamic_sampling/kept_groups"] == 1


def test_the_data_position_goes_on_from_where_the_step_started(tmp_path):
    script = {2: ALL_RIGHT, 3: ALL_RIGHT, 4: MIXED, 5: ALL_WRONG_LENGTHS_DIFFER, 6: MIXED_2, 7: MIXED}
    batch, after, m, groups, _, _ = run(tmp_path, script, position=2)
    assert groups == [4, 6]
    assert after == 8 and m["dynamic_sampling/gen_batches"] == 3


def test_without_dynamic_sampling_every_group_is_kept(tmp_path):
    script = {0: ALL_WRONG_LENGTHS_DIFFER, 1: ALL_RIGHT}
    batch, after, m, groups, _, _ = run(tmp_path, script, "grpo.dynamic_sampling.enabled=false")
    assert groups == [0, 1] and after == 2 and "dynamic_sampling/gen_batches" not in m


@pytest.mark.parametrize("scores, metric, expected", [
    ([0.0, 0.0, 0.0], "reward", False),
    ([1.0, 0.0, 1.0], "reward", True),
    ([0.5, 0.0, 0.0], "reward", True),       # partial credit differs
    ([0.5, 0.0, 0.0], "accuracy", False),    # ... but none is correct
    ([1.0, 0.5, 1.0], "accuracy", True),
    ([1.0, 2.0, 1.5], "reward", False),      # reward_scaling clamps all three to its top: no signal
    ([1.0, 2.0, 1.5], "accuracy", False),
])
def test_informative_judges_the_metric_never_the_penalty(scores, metric, expected):
    g = typed(compose([f"grpo.dynamic_sampling.metric={metric}", "grpo.overlong_penalty.enabled=true"])).grpo
    assert advantages.informative(scores, g) is expected


def test_the_metric_is_one_of_reward_or_accuracy():
    from launcher.config.validate import validate

    errs = [str(e) for e in validate(typed(compose(["grpo.dynamic_sampling.metric=score"])), submitting=False)]
    assert errs == ["grpo.dynamic_sampling.metric: must be one of reward, accuracy, got 'score'"]
