"""The multi-turn episode loop (launcher.driver.episodes) on a scripted generator (no Ray, no vLLM),
with the environments in real worker processes: the episode's tokens against the chat template
rendered as a whole, the loss mask, budgets, turn limits, and an environment's errors and timeouts."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest

from launcher.config.compose import compose
from launcher.config.schema import typed
from launcher.driver import episodes
from launcher.driver.data import Example
from launcher.driver.environments import Environments
from launcher.driver.rewards import RewardFailed
from launcher.driver.rollout import build_batch
from workers.tiny_models import make_tokenizer

TOK = make_tokenizer(chat=True)   # ChatML, word-level: every word below is in its vocabulary

# a user's environment, written as the minimal form: one user turn per reply, done after `turns`
ENV = textwrap.dedent('''
    import time

    class Env:
        def __init__(self, example):
            self.example, self.turn = example, 0

        def first_messages(self):
            return [{"role": "system", "content": "say a number"}, {"role": "user", "content": self.example["q"]}]

        def respond(self, reply):
            self.turn += 1
            how = self.example.get("how", "")
            if how == "raise" and self.turn == 2:
                raise KeyError("no such word")
            if how == "sleep" and self.turn == 2:
                time.sleep(30)
            if how == "nan":
                return {"messages": [], "reward": float("nan"), "done": True}
            if how == "no-done":
                return {"messages": [{"role": "user", "content": "no"}], "reward": 0.5}
            done = self.turn >= self.example.get("turns", 2)
            return {"messages": [] if done else [{"role": "user", "content": "no , plus ."}],
                    "reward": 0.25 * self.turn, "done": done, "metrics": {"asked": 1}}
''')


class ScriptedEngine:
    """What vLLM returns, for replies given as text: the words' token ids then the end of turn."""

    def __init__(self, reply: str = "12 13", eos: bool = True):
        self.reply, self.eos, self.calls = reply, eos, []

    def generate(self, prompts, temperature, top_p, max_tokens, seeds):
        self.calls.append({"prompts": [list(p) for p in prompts], "max_tokens": list(max_tokens), "seeds": seeds})
        outs = []
        for limit in max_tokens:
            ids = TOK(self.reply, add_special_tokens=False)["input_ids"] + ([TOK.eos_token_id] if self.eos else [])
            ids = ids[:limit]
            outs.append(SimpleNamespace(token_ids=ids, text=TOK.decode(ids, skip_special_tokens=True),
                                        logprobs=[-0.5] * len(ids),
                                        finish_reason="stop" if TOK.eos_token_id in ids else "length"))
        return outs


def run(tmp_path, records, *overrides, engine=None):
    env = tmp_path / "env.py"
    env.write_text(ENV)
    cfg = typed(compose([f"env.fn={env}:Env", "grpo.num_generations_per_prompt=2", "reward.workers=2",
                         "reward.timeout_s=60", *overrides]))  # a loaded machine's worker can be slow
    envs = Environments(cfg, tmp_path / "run")
    engine = engine or ScriptedEngine()
    examples = [Example(i, r, where=f"line {i + 1} of train.jsonl") for i, r in enumerate(records)]
    try:
        return episodes.sample(cfg, engine, envs, TOK, examples, step=3), engine, cfg
    finally:
        envs.close()


def ids_of(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def test_an_episodes_tokens_are_the_whole_conversation_as_the_template_renders_it(tmp_path):
    r, engine, cfg = run(tmp_path, [{"q": "what is 2 + 3 ?", "turns": 3}])
    messages = [{"role": "system", "content": "say a number"}, {"role": "user", "content": "what is 2 + 3 ?"}]
    for turn in range(3):
        messages.append({"role": "assistant", "content": "12 13"})
        if turn < 2:
            messages.append({"role": "user", "content": "no , plus ."})
    whole = ids_of(TOK.apply_chat_template(messages, tokenize=False))
    got = r.prompt_ids[0] + r.response_ids[0]
    assert got == whole[:len(got)] and TOK.decode(whole[len(got):]).strip() == ""   # only the template's last "\n"
    assert r.prompt_ids[0] == ids_of(TOK.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True))
    # the loss covers the model's tokens only: 3 turns of "12 13 <|im_end|>"
    model = [t for t, m in zip(r.response_ids[0], r.response_mask[0]) if m]
    assert model == (ids_of("12 13") + [TOK.eos_token_id]) * 3
    assert [lp for lp, m in zip(r.generation_logprobs[0], r.response_mask[0]) if not m] == \
        [0.0] * (len(r.response_ids[0]) - 9)
    assert r.rewards == [0.25 + 0.5 + 0.75] * 2 and r.reward_errors == 0
    assert r.episodes[0] == {"env/turns": 3, "env/episode_tokens": len(r.response_ids[0]), "env/asked": 3.0}
    # each turn is one batch of requests, the first seeded as the single-turn request is
    from launcher.driver.rollout import request_seed

    assert len(engine.calls) == 3 and engine.calls[0]["seeds"] == [request_seed(cfg.run.seed, 3, 0, j) for j in (0, 1)]
    assert len({s for c in engine.calls for s in c["seeds"]}) == 6

    batch = build_batch(r, [1.0, -1.0], TOK.pad_token_id)
    p = len(r.prompt_ids[0])
    assert batch["loss_mask"][0, p:p + len(r.response_ids[0])].tolist() == [float(m) for m in r.response_mask[0]]
    assert batch["loss_mask"][0, :p].sum() == 0


def test_turn_limit_and_token_budget_end_an_episode(tmp_path):
    r, _, _ = run(tmp_path, [{"q": "what is 2 + 3 ?", "turns": 50}], "grpo.max_turns=2")
    assert r.episodes[0]["env/turns"] == 2 and sum(r.response_mask[0]) == 6

    r, engine, cfg = run(tmp_path, [{"q": "what is 2 + 3 ?", "turns": 50}], "grpo.max_turns=20",
                         "grpo.max_total_sequence_length=40", "vllm.max_model_len=40", "grpo.max_new_tokens=8")
    assert all(len(p) + len(s) <= 40 for p, s in zip(r.prompt_ids, r.response_ids))
    assert all(c["max_tokens"] == [min(8, 40 - len(p)) for p in c["prompts"]] for c in engine.calls)
    assert r.episodes[0]["env/turns"] < 20


def test_a_truncated_reply_is_closed_as_the_template_closes_a_turn(tmp_path):
    r, _, _ = run(tmp_path, [{"q": "what is 2 + 3 ?", "turns": 2}], engine=ScriptedEngine(eos=False))
    text = TOK.decode(r.prompt_ids[0] + r.response_ids[0], skip_special_tokens=False)
    # system, user, the first reply's (the template's, after the model's own tokens), the observation's
    assert text.count("<|im_end|>") == 4 and "assistant 12 13 <|im_end|> <|im_start|> user no" in text
    assert text.endswith("assistant 12 13")
    assert r.truncated == [True, True]


@pytest.mark.parametrize("how, says", [
    ("raise", "KeyError: 'no such word'"),
    ("sleep", "timed out after 8s (reward.timeout_s)"),
    ("nan", "respond()['reward'] returned nan, not a finite number"),
    ("no-done", "respond()['done'] must be true or false, got None"),
])
def test_an_environment_error_ends_its_episode_counted_and_logged(tmp_path, how, says):
    r, _, _ = run(tmp_path, [{"q": "what is 2 + 3 ?", "how": how}, {"q": "what is 2 + 3 ?", "turns": 2}],
                  *(["reward.timeout_s=8"] if how == "sleep" else []))  # the environment sleeps 30 s
    if how == "sleep":  # both workers were replaced: the other record's episodes, held there, went with them
        assert r.reward_errors == 4 and r.rewards[2:] == [0.25, 0.25]
    else:
        assert r.reward_errors == 2  # both episodes of the failing record
        assert r.rewards[2:] == [0.75, 0.75]  # the other record's are whole
    log = (tmp_path / "run" / "logs" / "reward_errors.log").read_text()
    assert "on line 1 of train.jsonl" in log and says in log.splitlines()[0]


def test_on_error_fail_stops_naming_the_record(tmp_path):
    with pytest.raises(RewardFailed, match=r"failed in respond\(\) on line 1 of train.jsonl: KeyError"):
        run(tmp_path, [{"q": "what is 2 + 3 ?", "how": "raise"}], "reward.on_error=fail")


def test_reward_fn_given_on_the_command_line_scores_the_last_reply(tmp_path):
    r, _, _ = run(tmp_path, [{"q": "what is 2 + 3 ?", "turns": 1, "answer": 12}], "reward=math_answer")
    assert r.rewards == [0.25 + 1.0] * 2
    cfg = typed(compose([f"env.fn={tmp_path / 'env.py'}:Env"]))
    assert cfg.reward.fn is None  # the default group's demo reward does not score episodes


# ---------------------------------------------------------------------------- env.fn=tools
TOOLS = textwrap.dedent('''
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b
''')


class ScriptedTurns(ScriptedEngine):
    """Turn k of every episode replies replies[k] (text; a byte-level tokenizer round-trips it)."""

    def __init__(self, tok, replies):
        super().__init__()
        self.tok, self.replies, self.turn = tok, replies, 0

    def generate(self, prompts, temperature, top_p, max_tokens, seeds):
        self.calls.append({"prompts": [list(p) for p in prompts], "max_tokens": list(max_tokens)})
        text = self.replies[min(self.turn, len(self.replies) - 1)]
        self.turn += 1
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [SimpleNamespace(token_ids=ids, text=text, logprobs=[-0.1] * len(ids), finish_reason="stop")
                for _ in prompts]


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def run_tools(tmp_path, replies, *overrides):
    from tests.helpers.byte_tokenizer import make

    tok = make()  # the published Qwen2.5 chat template, tools and <tool_response> included
    (tmp_path / "tools.py").write_text(TOOLS)
    cfg = typed(compose(["env.fn=tools", f"env.tools=[{tmp_path / 'tools.py'}:add]", "reward=math_answer",
                         "grpo.num_generations_per_prompt=2", "reward.workers=1", "reward.timeout_s=60",
                         "grpo.max_total_sequence_length=2048", "vllm.max_model_len=2048", "grpo.max_new_tokens=64",
                         *overrides]))
    envs = Environments(cfg, tmp_path / "run")
    engine = ScriptedTurns(tok, replies)
    try:
        r = episodes.sample(cfg, engine, envs, tok, [Example(0, {"prompt": "what is 2 + 3 ?", "answer": 5})], step=1)
    finally:
        envs.close()
    return r, tok, engine


def test_a_tool_call_is_run_and_its_result_rendered_as_the_template_renders_tool_messages(tmp_path):
    from launcher.driver.tool_calls import schema

    r, tok, engine = run_tools(tmp_path, [CALL, "5"])
    assert r.rewards == [1.0, 1.0] and r.reward_errors == 0   # math_answer on the last reply
    assert r.episodes[0] == {"env/turns": 2, "env/episode_tokens": len(r.response_ids[0]), "env/tool_calls": 1.0,
                             "env/tool_errors": 0.0}
    ns: dict = {}
    exec(TOOLS, ns)
    messages = [{"role": "user", "content": "what is 2 + 3 ?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]
    whole = tok.apply_chat_template(messages, tools=[schema(ns["add"])], tokenize=False)
    got = tok.decode(r.prompt_ids[0] + r.response_ids[0], skip_special_tokens=False)
    assert whole.startswith(got) and whole[len(got):] == "\n"   # the whole conversation as the template has it
    assert '"name": "add"' in tok.decode(r.prompt_ids[0]) and "<tools>" in tok.decode(r.prompt_ids[0])
    env_text = tok.decode([t for t, m in zip(r.response_ids[0], r.response_mask[0]) if not m])
    assert env_text == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_malformed_tool_call_is_answered_with_an_error_and_counted(tmp_path):
    r, tok, _ = run_tools(tmp_path, ['<tool_call>\n{"name": "add", "arguments": {"a": 2,}\n</tool_call>', "4"])
    assert r.rewards == [0.0, 0.0] and r.reward_errors == 0   # the model's mistake, not the environment's
    assert r.episodes[0]["env/tool_errors"] == 1.0 and r.episodes[0]["env/tool_calls"] == 0.0
    env_text = tok.decode([t for t, m in zip(r.response_ids[0], r.response_mask[0]) if not m])
    assert "<tool_response>\nerror: tool call 1:" in env_text


def test_the_readme_environment_runs_on_the_readme_records(tmp_path):
    """README.md's my_env.py on its train.jsonl, as printed: a right reply ends the episode rewarded."""
    import json

    from tests.helpers import readme

    (tmp_path / "my_env.py").write_text(readme.block_after("my_env.py"))
    record = json.loads(readme.block_after("train.jsonl").splitlines()[0])
    cfg = typed(compose([f"env.fn={tmp_path / 'my_env.py'}:Env", "reward.workers=1", "reward.timeout_s=60"]))
    envs = Environments(cfg, tmp_path / "run")
    try:
        r = episodes.sample(cfg, ScriptedEngine(reply=str(record["solution"])), envs, TOK,
                            [Example(0, record, where="line 1 of train.jsonl")], step=1)
        wrong = episodes.sample(cfg, ScriptedEngine(reply="12"), envs, TOK,
                                [Example(0, record, where="line 1 of train.jsonl")], step=1)
    finally:
        envs.close()
    n = cfg.grpo.num_generations_per_prompt
    assert r.rewards == [1.0] * n and [m["env/turns"] for m in r.episodes] == [1] * n
    assert wrong.rewards == [0.0] * n and [m["env/turns"] for m in wrong.episodes] == [4] * n  # grpo.max_turns


def test_the_environments_tokens_carry_no_loss(tmp_path):
    """The GRPO loss of an episode's batch (workers.trainer.loss): whatever the logprobs say at the
    environment's positions, the loss and its gradient are the same, and no gradient reaches them."""
    import torch

    from workers.trainer.loss import grpo_loss, loss_config

    r, _, _ = run(tmp_path, [{"q": "what is 2 + 3 ?", "turns": 3}])
    batch = build_batch(r, [1.0, -1.0], TOK.pad_token_id)
    env = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
    for i, p in enumerate(r.prompt_ids):
        env[i, len(p):len(p) + len(r.response_ids[i])] = torch.tensor(r.response_mask[i]) == 0
    assert env.sum() > 0

    def loss_and_grad(noise: float):
        g = torch.Generator().manual_seed(0)
        logprobs = (-torch.rand(batch["loss_mask"].shape, generator=g)).requires_grad_()
        prev = logprobs.detach() + 0.05 * torch.randn(logprobs.shape, generator=g)
        gen = batch["generation_logprobs"].clone()
        prev[env] += noise
        gen[env] += noise
        loss, _ = grpo_loss(logprobs, prev, batch["advantages"], batch["loss_mask"], loss_config({}),
                            generation_logprobs=gen)
        loss.backward()
        return loss.detach(), logprobs.grad

    loss, grad = loss_and_grad(0.0)
    loss2, grad2 = loss_and_grad(3.0)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    assert grad[env].abs().sum() == 0 and grad[batch["loss_mask"] > 0].abs().sum() > 0
