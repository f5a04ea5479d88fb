"""Train/generation agreement per refit mode, in bf16 and float32, over training steps.

One Megatron-Bridge LoRA trainer (TP=1, B initialised to zero, Adam at a realistic learning
rate, so the LoRA deltas stay small against the base weights) and two in-process vLLM engines
of the same dtype (a plain one for `merged` and `merged_delta`, a LoRA-enabled one for `adapter`)
on a local Ray. Step 0 is before any training (B = 0: the generator and the trainer hold the same
weights, so what is left is the two sides' kernels: the floor). At every step each mode refits
its engine from the same trainer state exactly as the GRPO driver does (`ObjectStoreRefit.push`), samples
the same seeded requests, and the trainer scores the sampled tokens; `gen_kl_error` and
`token_mult_prob_error` are the driver's own metrics (launcher.driver.agreement). Then one GRPO
optimizer step on the first mode's samples (reward: the share of even token ids in the
response, a learnable signal), so every mode is compared against the same trainer at every step.
"vs trainer without LoRA" compares the generator with the trainer's adapters switched off (the
base policy): a mode that loses the delta agrees better with that than with the trainer; "policy
moved" is the same k3 estimate between the trainer with and without its adapters, i.e. how far
training has taken the policy, to read against the floor. "delta / W" is the RMS of the merged
LoRA delta (alpha/r) B A (float32, from the adapter factors) over the RMS of the targeted base
weights, next to bf16's relative resolution 2^-8 = 0.0039.

    python benchmarks/agreement.py                               # llama_100m, bf16 + float32
    python benchmarks/agreement.py --tiny --steps 2 --dtypes bf16   # what CI runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODES = ("merged", "merged_delta", "adapter")
DTYPES = {"bf16": "bfloat16", "float32": "float32"}
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def trainer_group(model_dir: Path, dtype: str, lr: float, dim: int, alpha: float, steps: int):
    from workers.trainer.config import TrainerConfig
    from workers.trainer.group import TrainerGroup

    peft = {"enabled": True, "target_modules": TARGETS, "dim": dim, "alpha": alpha, "dropout": 0.0,
            "lora_A_init_method": "xavier", "lora_B_init_method": "zero"}
    config = TrainerConfig.from_sections(str(model_dir), parallel={"tensor_parallel": 1}, peft=peft,
                                         optim={"lr": lr, "min_lr": lr}, dtype=dtype, seed=1, max_num_steps=steps)
    return TrainerGroup(config, num_ranks=1)


def delta_rms(trainers, alpha: float, dim: int) -> float:
    """RMS of the merged LoRA delta (alpha/r) B A over all targeted linears (float32)."""
    state = trainers.adapter_state()
    num = 0.0
    count = 0
    for name, a in state.items():
        if "linear_in" not in name:
            continue
        b = state[name.replace("linear_in", "linear_out")]
        delta = (alpha / dim) * (b.float() @ a.float())
        num += float((delta ** 2).sum())
        count += delta.numel()
    return (num / max(count, 1)) ** 0.5


def base_rms(model_dir: Path) -> float:
    """RMS of the targeted base weights in the HF checkpoint (attention and MLP projections)."""
    from safetensors import safe_open

    total, count = 0.0, 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k.endswith("proj.weight"):
                    t = st.get_tensor(k).float()
                    total += float((t ** 2).sum())
                    count += t.numel()
    return (total / max(count, 1)) ** 0.5


def batch_for(outs, prompts, pad_id: int, advantages):
    from launcher.driver.rollout import Rollout, build_batch

    r = Rollout(prompts, [o.token_ids for o in outs], [o.logprobs for o in outs], [0.0] * len(outs))
    return build_batch(r, advantages, pad_id)


def group_advantages(rewards: list[float], n: int) -> list[float]:
    out = []
    for i in range(0, len(rewards), n):
        g = rewards[i:i + n]
        mean, std = statistics.fmean(g), statistics.pstdev(g)
        out += [(r - mean) / (std + 1e-6) for r in g]
    return out


def run_dtype(model_dir: Path, label: str, args) -> list[dict]:
    from launcher.driver.agreement import agreement_metrics, gen_kl_error
    from launcher.driver.rollout import request_seed
    from workers.generator.actor import GeneratorConfig
    from workers.generator.group import GeneratorGroup

    from workers.refit import control as refit
    dtype = DTYPES[label]
    slot = [{"resources": {"generation_slot": 1}, "num_cpus": 1}]
    t = time.time()
    trainers = trainer_group(model_dir, dtype, args.lr, args.dim, args.alpha, args.steps)
    engines = {}
    if {"merged", "merged_delta"} & set(args.modes):
        engines["plain"] = GeneratorGroup(GeneratorConfig(model=str(model_dir), dtype=dtype), slot, ready_timeout_s=900)
    if "adapter" in args.modes:
        engines["lora"] = GeneratorGroup(GeneratorConfig(model=str(model_dir), dtype=dtype, enable_lora=True,
                                                         max_lora_rank=args.dim), slot, ready_timeout_s=900)
    print(f"{label}: trainer + {len(engines)} engine(s) up in {time.time() - t:.0f}s", flush=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    n = args.samples
    prompts = [[4 + (11 * p + 7 * j) % (vocab - 4) for j in range(12)] for p in range(args.prompts)]
    requests = [p for p in prompts for _ in range(n)]
    w_rms = base_rms(model_dir)
    rows = []
    try:
        for step in range(args.steps + 1):
            ratio = delta_rms(trainers, args.alpha, args.dim) / w_rms
            seeds = [request_seed(7, step, i // n, i % n) for i in range(len(requests))]
            train_batch = None
            for mode in args.modes:
                gen = engines["lora" if mode == "adapter" else "plain"]
                report = refit.ObjectStoreRefit(trainers, gen, mode, 256).push(step)
                outs = gen.generate(requests, temperature=1.0, max_tokens=args.tokens, seeds=seeds)
                rewards = [sum(1 for tok in o.token_ids if tok % 2 == 0) / max(len(o.token_ids), 1) for o in outs]
                batch = batch_for(outs, requests, 0, group_advantages(rewards, n))
                batch["prev_logprobs"] = trainers.logprobs(batch)
                base_lp = trainers.logprobs(batch, adapters=False)  # the trainer without its LoRA deltas
                gen_lp, mask = batch["generation_logprobs"], batch["loss_mask"]
                agree = agreement_metrics(gen_lp, batch["prev_logprobs"], mask)
                rows.append({"dtype": label, "mode": mode, "step": step, "delta_over_w": ratio,
                             "refit_s": report.transfer_and_update_weights_s, "reward": statistics.fmean(rewards),
                             "gen_kl_vs_base": gen_kl_error(gen_lp, base_lp, mask),
                             "policy_moved": gen_kl_error(base_lp, batch["prev_logprobs"], mask), **agree})
                print(f"  {label:7s} step {step:2d} {mode:12s} gen_kl_error {agree['gen_kl_error']:.3e} "
                      f"(vs base {rows[-1]['gen_kl_vs_base']:.3e}, policy moved {rows[-1]['policy_moved']:.3e})  "
                      f"token_mult_prob_error {agree['token_mult_prob_error']:.6f}  delta/W {ratio:.2e}", flush=True)
                if train_batch is None:
                    train_batch = batch
            if step < args.steps:
                trainers.train(train_batch)
    finally:
        for g in engines.values():
            g.shutdown()
        trainers.shutdown()
    return rows


def run(args) -> list[dict]:
    import ray

    from workers import cpu_shim, tiny_models

    cpu_shim.apply("cpu")
    model_dir = tiny_models.build(Path(args.cache) / f"{args.model}-std{args.init_std:g}", args.model,
                                  init_std=args.init_std)
    own = not ray.is_initialized()  # else in a Ray of the caller's (the test suite's) with these resources
    if own:
        ray.init(num_cpus=4, resources={"train_slot": 1, "generation_slot": 2}, include_dashboard=False,
                 object_store_memory=1536 * 2**20, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        return [row for label in args.dtypes for row in run_dtype(model_dir, label, args)]
    finally:
        if own:
            ray.shutdown()


def rounding(model_dir: Path, ratios=(1e-4, 1e-3, 1e-2, 1e-1), dim: int = 16, seed: int = 0) -> list[dict]:
    """What a bf16 merged refit keeps of a LoRA delta, on the checkpoint's real q_proj weights.

    For a random rank-`dim` delta d scaled to `ratio` x RMS(W): the trainer's effective weight is
    bf16(W) + d (bf16 base, LoRA path exact); a generator gets either bf16(bf16(W) + d) (`merged`,
    and `merged_delta` as it is: the base in the engine's dtype) or bf16(W_fp32 + d) (the base kept
    in float32). Reported: the share of weights the delta leaves unchanged, and the error of the
    delta's effect on outputs, |(W_gen - W_trainer) x| / |d x| over random inputs x."""
    import torch
    from safetensors import safe_open

    f = sorted(model_dir.glob("*.safetensors"))[0]
    with safe_open(str(f), "pt") as st:
        name = next(k for k in st.keys() if k.endswith("q_proj.weight"))
        w = st.get_tensor(name).float()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(w.shape[1], 64, generator=g)
    base16 = w.to(torch.bfloat16)
    out = []
    for ratio in ratios:
        d = torch.randn(w.shape[0], dim, generator=g) @ torch.randn(dim, w.shape[1], generator=g)
        d *= ratio * w.pow(2).mean().sqrt() / d.pow(2).mean().sqrt()
        trainer = base16.float() + d
        row = {"ratio": ratio}
        for label, gen in (("bf16 base", (base16.float() + d).to(torch.bfloat16)),
                           ("float32 base", (w + d).to(torch.bfloat16))):
            changed = (gen != base16).float().mean().item()
            err = ((gen.float() - trainer) @ x).norm() / (d @ x).norm()
            row[label] = {"changed": changed, "output_error": float(err)}
        out.append(row)
    return out


def rounding_table(rows: list[dict]) -> str:
    head = ("| delta / W (RMS) | bf16 base + delta: weights changed | its error of the delta's effect "
            "| float32 base + delta: weights changed | its error of the delta's effect |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        a, b = r["bf16 base"], r["float32 base"]
        lines.append(f"| {r['ratio']:.0e} | {100 * a['changed']:.2f}% | {a['output_error']:.2f} | "
                     f"{100 * b['changed']:.2f}% | {b['output_error']:.2f} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = ("| dtype | mode | gen_kl_error step 0 (floor) | gen_kl_error steps 1..N mean | max | last "
            "| last vs trainer without LoRA | policy moved (last) | max token_mult_prob_error | delta / W (last) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (dtype, mode) in dict.fromkeys((r["dtype"], r["mode"]) for r in rows):
        rs = [r for r in rows if (r["dtype"], r["mode"]) == (dtype, mode)]
        later = [r["gen_kl_error"] for r in rs if r["step"] > 0] or [float("nan")]
        lines.append(f"| {dtype} | {mode} | {rs[0]['gen_kl_error']:.2e} | {statistics.fmean(later):.2e} | "
                     f"{max(later):.2e} | {rs[-1]['gen_kl_error']:.2e} | {rs[-1]['gen_kl_vs_base']:.2e} | "
                     f"{rs[-1]['policy_moved']:.2e} | "
                     f"{max(r['token_mult_prob_error'] for r in rs):.6f} | {rs[-1]['delta_over_w']:.1e} |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (dtype, mode) in dict.fromkeys((r["dtype"], r["mode"]) for r in rows):
        rs = [r for r in rows if (r["dtype"], r["mode"]) == (dtype, mode)]
        ax.semilogy([r["step"] for r in rs], [max(r["gen_kl_error"], 1e-18) for r in rs],
                    linestyle="-" if dtype == "bf16" else "--", marker="o", markersize=3, label=f"{mode} ({dtype})")
    ax.set(xlabel="training step (0: before any step)", ylabel="gen_kl_error",
           title="trainer vs vLLM logprobs per refit mode")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny_llama instead of llama_100m (CI)")
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dtypes", nargs="+", default=["bf16", "float32"], choices=list(DTYPES))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--init-std", type=float, default=0.08,
                   help="std of the random base weights (the project's tiny models use 0.08; HF's default is 0.02)")
    p.add_argument("--rounding-only", action="store_true",
                   help="only the weight-level table (what bf16 rounding keeps of a delta; seconds, no Ray)")
    p.add_argument("--out", default=None, help="directory for agreement.json and agreement.png")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "refit_bench_models"))
    args = p.parse_args(argv)
    args.model = args.model or ("tiny_llama" if args.tiny else "llama_100m")
    t = time.time()
    if args.rounding_only:
        from workers import tiny_models

        model_dir = tiny_models.build(Path(args.cache) / f"{args.model}-std{args.init_std:g}", args.model,
                                      init_std=args.init_std)
        print(rounding_table(rounding(model_dir, dim=args.dim)))
        return []
    rows = run(args)
    print(f"\n{args.model} (init std {args.init_std:g}), lr {args.lr:g}, LoRA dim {args.dim} alpha {args.alpha:g} on all linears, "
          f"{args.prompts}x{args.samples} requests x {args.tokens} tokens per step, {time.time() - t:.0f}s\n")
    print(table(rows))
    print()
    print(rounding_table(rounding(Path(args.cache) / f"{args.model}-std{args.init_std:g}", dim=args.dim)))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "agreement.json").write_text(json.dumps(rows, indent=1) + "\n")
        plot(rows, out / "agreement.png")
        print(f"\nwrote {out / 'agreement.json'} and {out / 'agreement.png'}")
    return rows


if __name__ == "__main__":
    main()
