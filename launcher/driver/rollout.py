"""One step's samples: prompts encoded, n seeded generations per prompt, rewards, and the batch the
trainers get (docs/architecture.md's contract).

Every request is seeded from (run seed, step, prompt, sample), so what is sampled does not depend
on the engines' history: a resumed run samples what an uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

from launcher.config.schema import Config


def request_seed(run_seed: int, step: int, prompt: int, sample: int) -> int:
    digest = hashlib.blake2b(f"{run_seed}:{step}:{prompt}:{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@dataclass
class Rollout:
    """What one step sampled, in request order (prompt-major: p0 s0, p0 s1, ..., p1 s0, ...)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    generation_logprobs: list[list[float]]
    rewards: list[float]
    texts: list[str] = field(default_factory=list)


def encode_prompt(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True))
    return list(tokenizer(text)["input_ids"])


def sample(cfg: Config, generators, tokenizer, examples: Sequence, step: int,
           reward_fn: Callable[[str, object], float]) -> Rollout:
    g = cfg.grpo
    prompts, seeds, targets = [], [], []
    for i, ex in enumerate(examples):
        ids = encode_prompt(tokenizer, ex.prompt)
        for j in range(g.num_generations_per_prompt):
            prompts.append(ids)
            seeds.append(request_seed(cfg.run.seed, step, i, j))
            targets.append(ex.target)
    outs = generators.generate(prompts, temperature=g.temperature, top_p=g.top_p,
                               max_tokens=g.max_new_tokens, seeds=seeds)
    rewards = [reward_fn(o.text, t) for o, t in zip(outs, targets)]
    return Rollout(prompts, [o.token_ids for o in outs], [o.logprobs for o in outs], rewards,
                   [o.text for o in outs])


def build_batch(r: Rollout, adv: list[float], pad_id: int) -> dict:
    """docs/architecture.md's batch: prompt + response right-padded; value at t = log p(x_t | x_<t)."""
    import torch

    lengths = [len(p) + len(s) for p, s in zip(r.prompt_ids, r.response_ids)]
    T = max(lengths)
    B = len(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    gen_lp = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, s, lp) in enumerate(zip(r.prompt_ids, r.response_ids, r.generation_logprobs)):
        input_ids[i, : len(p) + len(s)] = torch.tensor(p + s, dtype=torch.long)
        loss_mask[i, len(p): len(p) + len(s)] = 1.0
        gen_lp[i, len(p): len(p) + len(s)] = torch.tensor(lp, dtype=torch.float32)
    return {"input_ids": input_ids, "loss_mask": loss_mask, "generation_logprobs": gen_lp,
            "advantages": torch.tensor(adv, dtype=torch.float32)}
