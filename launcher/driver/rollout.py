"""One step's samples: prompts encoded, n seeded generations per prompt, rewards, and the batch the
trainers get (docs/architecture.md's contract).

Every request is seeded from (run seed, step, prompt, sample), so what is sampled does not depend
on the engines' history: a resumed run samples what an uninterrupted run would have. With DAPO
dynamic sampling, round r of a step numbers its prompts from r * num_prompts_per_step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

from launcher import metric_names as names
from launcher.config.schema import Config
from workers.contracts import TrainerBatch


def request_seed(run_seed: int, step: int, prompt: int, sample: int, turn: int = 0) -> int:
    """A request's seed; `turn` > 0: a later turn of a multi-turn episode (turn 0 is the single-turn seed)."""
    key = f"{run_seed}:{step}:{prompt}:{sample}" + (f":{turn}" if turn else "")
    digest = hashlib.blake2b(key.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@dataclass
class Rollout:
    """What one step sampled, in request order (prompt-major: p0 s0, p0 s1, ..., p1 s0, ...)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    generation_logprobs: list[list[float]]
    rewards: list[float]
    texts: list[str] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)   # stopped by max_new_tokens
    reward_errors: int = 0
    # multi-turn episodes (launcher.driver.episodes); empty for single-turn samples
    response_mask: list[list[int]] = field(default_factory=list)   # 1: the model's token (loss), 0: the environment's
    episodes: list[dict] = field(default_factory=list)             # per episode: turns, tokens, the env's metrics

    PER_SAMPLE = ("prompt_ids", "response_ids", "generation_logprobs", "rewards", "texts", "truncated",
                  "response_mask", "episodes")

    def groups(self, n: int) -> list["Rollout"]:
        """One Rollout per prompt (its n samples)."""
        return [Rollout(**{k: getattr(self, k)[i:i + n] for k in self.PER_SAMPLE})
                for i in range(0, len(self.rewards), n)]

    @staticmethod
    def join(parts: Sequence["Rollout"], reward_errors: int = 0) -> "Rollout":
        return Rollout(**{k: [x for p in parts for x in getattr(p, k)] for k in Rollout.PER_SAMPLE},
                       reward_errors=reward_errors)


def sample(cfg: Config, generators, prompt_ids: Sequence[list[int]], examples: Sequence, step: int, rewards,
           first_prompt: int = 0, greedy: bool = False) -> Rollout:
    """n generations of each prompt (one, at temperature 0, when `greedy`), scored by `rewards`; with
    env.fn, n episodes of each example (`rewards`: environments.Environments, the prompts unused)."""
    if cfg.env.fn is not None:  # launcher.driver.episodes, through the environments
        return rewards.sample(generators, examples, step, first_prompt, greedy)
    g = cfg.grpo
    n = 1 if greedy else g.num_generations_per_prompt
    prompts, seeds, served = [], [], []
    for i, (ids, ex) in enumerate(zip(prompt_ids, examples)):
        for j in range(n):
            prompts.append(ids)
            seeds.append(request_seed(cfg.run.seed, step, first_prompt + i, j))
            served.append(ex)
    outs = generators.generate(prompts, temperature=0.0 if greedy else g.temperature, top_p=1.0 if greedy else g.top_p,
                               max_tokens=g.max_new_tokens, seeds=seeds)
    texts = [o.text for o in outs]
    scores, errors = rewards.score(texts, served)
    return Rollout(prompts, [o.token_ids for o in outs], [o.logprobs for o in outs], scores, texts,
                   [o.finish_reason == "length" for o in outs], errors)


def collect(cfg: Config, generators, prompts, rewards, step: int, position: int) -> tuple[Rollout, int, dict]:
    """The step's training samples from data position `position`: (rollout, the position after, metrics).

    With grpo.dynamic_sampling (DAPO) prompt groups whose scores are all equal (advantages.informative:
    on grpo.dynamic_sampling.metric, never on the overlong penalty) carry no signal and are dropped;
    further rounds of num_prompts_per_step prompts are sampled until that many informative groups
    or max_gen_batches rounds, the batch topped up with dropped groups, first sampled first, if
    short, so its size is fixed (their advantage is 0, or the overlong penalty's alone when it is on).
    Every round's prompts count as consumed."""
    from launcher.driver.advantages import informative

    g = cfg.grpo
    n, want = g.num_generations_per_prompt, g.num_prompts_per_step
    rounds = g.dynamic_sampling.max_gen_batches if g.dynamic_sampling.enabled else 1
    kept, spare, skipped, errors, generated = [], [], 0, 0, 0
    for r in range(rounds):
        examples, ids, position, dropped = prompts.take(position, want)
        part = sample(cfg, generators, ids, examples, step, rewards, first_prompt=r * want)
        skipped, errors, generated = skipped + dropped, errors + part.reward_errors, generated + len(part.rewards)
        for grp in part.groups(n):
            (kept if not g.dynamic_sampling.enabled or informative(grp.rewards, g) else spare).append(grp)
        if len(kept) >= want:
            break
    full = min(len(kept), want)
    batch = Rollout.join(kept[:want] + spare[:want - full], reward_errors=errors)
    m = {names.DROPPED_PROMPTS: skipped, names.REWARD_ERRORS: errors,
         names.TRUNCATED_FRACTION: sum(batch.truncated) / len(batch.truncated), **episode_means(batch)}
    if g.dynamic_sampling.enabled:
        m.update({names.KEPT_GROUPS: full, names.GEN_BATCHES: r + 1, names.GENERATED_SAMPLES: generated})
    return batch, position, m


def validation(cfg: Config, generators, val, rewards, step: int) -> dict:
    """Greedy generation over the validation prompts (`val`: (examples, ids)): val/reward, val/accuracy."""
    from launcher.driver.advantages import correct

    examples, ids = val
    r = sample(cfg, generators, ids, examples, step, rewards, greedy=True)
    return {**{names.VAL + k: v for k, v in episode_means(r).items()}, names.VAL_REWARD: sum(r.rewards) / len(r.rewards),
            names.VAL_ACCURACY: sum(1 for x in r.rewards if correct(x)) / len(r.rewards),
            names.VAL_REWARD_ERRORS: r.reward_errors, names.VAL_SAMPLE: r.texts[0]}


def episode_means(r: Rollout) -> dict:
    """Multi-turn episodes: the means over the batch of env/turns, env/episode_tokens and what the
    environment's respond() added (launcher.driver.environments); {} for single-turn samples."""
    keys = sorted({k for m in r.episodes for k in m})
    return {k: sum(m.get(k, 0.0) for m in r.episodes) / len(r.episodes) for k in keys}


def build_batch(r: Rollout, adv: list[float], pad_id: int) -> TrainerBatch:
    """workers.contracts.TrainerBatch: prompt + response right-padded; value at t = log p(x_t | x_<t)."""
    import torch

    lengths = [len(p) + len(s) for p, s in zip(r.prompt_ids, r.response_ids)]
    T = max(lengths)
    B = len(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    gen_lp = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, s, lp) in enumerate(zip(r.prompt_ids, r.response_ids, r.generation_logprobs)):
        input_ids[i, : len(p) + len(s)] = torch.tensor(p + s, dtype=torch.long)
        # a multi-turn episode's environment tokens carry no loss (response_mask 0)
        loss_mask[i, len(p): len(p) + len(s)] = torch.tensor(r.response_mask[i], dtype=torch.float32) \
            if r.response_mask else 1.0
        gen_lp[i, len(p): len(p) + len(s)] = torch.tensor(lp, dtype=torch.float32)
    return TrainerBatch(input_ids=input_ids, loss_mask=loss_mask, generation_logprobs=gen_lp,
                        advantages=torch.tensor(adv, dtype=torch.float32))
