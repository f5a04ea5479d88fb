"""Multi-turn episodes (env.fn): the model and an environment take turns until the environment says
done, grpo.max_turns model turns, or grpo.max_total_sequence_length tokens.

An episode is one sample of GRPO: its prompt is the first messages as the chat template renders
them, its "response" every token after it, the model's (loss on, generation logprobs kept) and the
environment's (loss off: launcher.driver.episode_tokens renders them) in turn; its reward is the sum
of what `respond` returned, plus reward.fn on the last reply when one is set. The group of a
record is its grpo.num_generations_per_prompt episodes, as for single-turn samples.

Each turn is one batch of requests to the engines (every episode still running), seeded from
(run seed, step, prompt, sample, turn): the first turn's seed is the single-turn request's, so an
episode, like a sample, is a function of the weights, the step and the data position. A turn's
max_tokens is grpo.max_new_tokens, or what is left of the episode's budget when that is less.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher import metric_names as names
from launcher.driver.episode_tokens import EpisodeTokens, TemplateError
from launcher.driver.rollout import Rollout, request_seed


@dataclass
class Episode:
    example: object                  # data.Example
    prompt_seq: int                  # the prompt's number in the step (seeds)
    sample: int
    messages: list[dict] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)         # 1: the model's token
    reply_start: int = 0             # where the model's last turn begins in response_ids
    logprobs: list[float] = field(default_factory=list)   # the engine's; 0.0 on the environment's tokens
    reward: float = 0.0
    turns: int = 0
    last_reply: str = ""
    truncated: bool = False
    done: bool = False
    error: bool = False
    metrics: dict = field(default_factory=dict)

    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def sample(cfg, generators, envs, tokenizer, examples, step: int, first_prompt: int = 0,
           greedy: bool = False) -> Rollout:
    """n episodes of each example (one, at temperature 0, when `greedy`); `envs`: environments.Environments."""
    g = cfg.grpo
    n = 1 if greedy else g.num_generations_per_prompt
    eps = [Episode(ex, first_prompt + i, j) for i, ex in enumerate(examples) for j in range(n)]
    keys = list(range(len(eps)))
    try:
        tools = _open(envs, eps, keys)
        render = EpisodeTokens(tokenizer, tools)
        for e in eps:
            if not e.done:
                e.prompt_ids = render.first(e.messages)
                if len(e.prompt_ids) >= g.max_total_sequence_length:
                    _end(envs, e, "first_messages()", ("error", f"the first messages are {len(e.prompt_ids)} tokens, "
                         f"grpo.max_total_sequence_length is {g.max_total_sequence_length}", ""))
        for turn in range(g.max_turns):
            live = [k for k in keys if not eps[k].done]
            if not live:
                break
            _model_turn(cfg, generators, [eps[k] for k in live], step, turn, greedy)
            answers = envs.respond(live, [eps[k].last_reply for k in live])
            for k, res in zip(live, answers):
                _environment_turn(cfg, envs, render, eps[k], res, last_turn=turn == g.max_turns - 1)
        if cfg.reward.fn is not None:
            scored = [k for k in keys if not eps[k].error]
            for k, res in zip(scored, envs.final_reward(scored, [eps[k].last_reply for k in scored],
                                                        [eps[k].example.record for k in scored])):
                if res[0] == "ok":
                    eps[k].reward += res[1]
                else:
                    _end(envs, eps[k], "reward.fn", res)
    except TemplateError as e:
        raise TemplateError(f"data.chat_template: {e}") from None
    finally:
        envs.close_all(keys)
    return _rollout(eps, [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0])


def _open(envs, eps: list[Episode], keys: list[int]) -> list | None:
    tools = None
    for e, res in zip(eps, envs.open(keys, [e.example.record for e in eps])):
        if res[0] != "ok":
            _end(envs, e, "first_messages()", res)
            continue
        e.messages, got = res[1]
        if got and tools is None:
            tools = got
    return tools


def _end(envs, e: Episode, what: str, res: tuple) -> None:
    """An episode whose environment (or reward) failed: it ends with what it scored so far, counted."""
    envs.failed(what, e.example.where, res)
    e.done, e.error = True, True


def _model_turn(cfg, generators, eps: list[Episode], step: int, turn: int, greedy: bool) -> None:
    g = cfg.grpo
    budgets = [min(g.max_new_tokens, g.max_total_sequence_length - e.length()) for e in eps]
    outs = generators.generate([e.prompt_ids + e.response_ids for e in eps],
                               temperature=0.0 if greedy else g.temperature, top_p=1.0 if greedy else g.top_p,
                               max_tokens=budgets,
                               seeds=[request_seed(cfg.run.seed, step, e.prompt_seq, e.sample, turn) for e in eps])
    for e, o in zip(eps, outs):
        e.reply_start = len(e.response_ids)
        e.response_ids += list(o.token_ids)
        e.mask += [1] * len(o.token_ids)
        e.logprobs += list(o.logprobs)
        e.last_reply, e.turns = o.text, e.turns + 1
        e.truncated = o.finish_reason == "length"


def _environment_turn(cfg, envs, render: EpisodeTokens, e: Episode, res: tuple, last_turn: bool) -> None:
    if res[0] != "ok":
        _end(envs, e, "respond()", res)
        return
    messages, reward, done, metrics = res[1]
    e.reward += reward
    for k, v in metrics.items():
        e.metrics[k] = e.metrics.get(k, 0.0) + v
    history = e.messages
    e.messages = history + [{"role": "assistant", "content": e.last_reply}] + messages
    room = cfg.grpo.max_total_sequence_length - e.length()
    if done or last_turn:
        e.done = True
        return
    if room <= 1:  # no room for the environment's answer and a reply: the episode ends at its budget
        e.done, e.truncated = True, True
        return
    obs = render.after_reply(history, e.response_ids[e.reply_start:], messages)
    if len(obs) >= room:  # no room left for the model to answer: the episode ends at its budget
        e.done, e.truncated = True, True
        return
    e.response_ids += obs
    e.mask += [0] * len(obs)
    e.logprobs += [0.0] * len(obs)


def _rollout(eps: list[Episode], placeholder: list[int]) -> Rollout:
    """An episode that ended before its first turn (its environment failed, its first messages too
    long) is the one token `placeholder` with nothing to learn from: it scores what it scored."""
    for e in eps:
        if not e.turns:
            e.prompt_ids, e.response_ids, e.mask, e.logprobs = list(placeholder), [], [], []
    return Rollout([e.prompt_ids for e in eps], [e.response_ids for e in eps], [e.logprobs for e in eps],
                   [e.reward for e in eps], [e.last_reply for e in eps], [e.truncated for e in eps],
                   sum(e.error for e in eps), response_mask=[e.mask for e in eps],
                   episodes=[{names.EPISODE_TURNS: e.turns, names.EPISODE_TOKENS: len(e.response_ids),
                              **{names.ENV + k: v for k, v in sorted(e.metrics.items())}} for e in eps])

