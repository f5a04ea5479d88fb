"""Hostile and mistaken inputs, one line per case (docs/security.md).

Each case: the command-line overrides, the files set up first (a `setup` function of the
sandbox), the expected exit code and the start of the one stderr line. After a refusal (exit 2)
nothing under the sandbox and nothing in the project's conf/ may have changed; a case can name
more paths that must be unchanged. Nothing is submitted or run: `_run_here` and `_submit` are
replaced by a sentinel so a case that wrongly passes validation fails loudly instead of starting a
job. Adding a case is one line in CASES.
"""

from __future__ import annotations

import functools
import hashlib
import json
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from launcher import __main__ as cli

REPO = Path(__file__).resolve().parents[2]
ROOT = "{root}"   # replaced by the sandbox's run.root
SANDBOX = "{sandbox}"   # replaced by the sandbox
SLURM = ["topology=slurm_3n"]


@dataclass
class Case:
    name: str
    argv: list[str]
    rc: int
    message: str                                   # the start of stderr's only line, after "error: "
    setup: Callable[[Path], None] | None = None    # files the case needs, under the sandbox
    unchanged: tuple[str, ...] = ()                # more paths (repo-relative) that must not change


@functools.lru_cache(maxsize=None)  # text: the same for every case that asks
def _config_yaml(*overrides: str) -> str:
    from launcher.config.compose import compose, to_yaml

    return to_yaml(compose(list(overrides)))


def _ckpt(run: str, step: int, info: dict | None = None, saved_config: bool = False, metrics: dict | None = None,
          trainer_step: int | None = None, files: dict | None = None, manifest: Callable[[dict], None] | None = None):
    """A complete checkpoint RUN/checkpoints/step_N as the driver and the trainers write it
    (tests/helpers/checkpoints.py), with RUN/config.yaml as a launch saves it (`saved_config`);
    `info` (training_info.json) and `files` (relative path -> text) forged afterwards, with a
    manifest rewritten to match (what anyone who can write the folder can do)."""
    def setup(sandbox: Path) -> None:
        from tests.helpers.checkpoints import checkpoint, rewrite_manifest

        if saved_config:
            (sandbox / "runs" / run).mkdir(parents=True, exist_ok=True)
            (sandbox / "runs" / run / "config.yaml").write_text("checkpointing:\n  dir: null\n")
        final = checkpoint(sandbox / "runs" / run / "checkpoints", step, config=_config_yaml(*SLURM), metrics=metrics,
                           trainer_step=trainer_step)
        if info is not None or files or manifest:
            if info is not None:
                (final / "training_info.json").write_text(json.dumps(info))
            for rel, text in (files or {}).items():
                (final / rel).write_text(text)
            rewrite_manifest(final)
        if manifest is not None:  # a manifest that is not one: its own schema refuses it
            m = json.loads((final / "manifest.json").read_text())
            manifest(m)
            (final / "manifest.json").write_text(json.dumps(m))
    return setup


def _ROLLOUTS(step: int, version: int = 5, position: int = 48, logprob: float = -0.5, tokens: int = 2,
              prompt: list | None = None) -> dict:
    """rollouts.json as a pipelined checkpoint at step 5 holds it (one prompt, one sample)."""
    return {"max_lag": 1, "sampling": {}, "rollouts": [
        {"step": step, "version": version, "position": position, "metrics": {}, "refit": {},
         "rollout": {"prompt_ids": [prompt or [1, 2]], "response_ids": [[3, 4]], "generation_logprobs": [[logprob] * tokens],
                     "rewards": [1.0], "texts": ["x"], "truncated": [False], "reward_errors": 0}}]}


# tiny_llama's config.json as transformers writes it (the keys of a published Llama config.json,
# scaled in depth and width to the built-in recipe, so no model fact differs from the conf)
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "head_dim": 32,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 1024, "rms_norm_eps": 1e-06, "vocab_size": 255, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "dtype": "float32"}


def _model(name: str, drop: tuple[str, ...] = (), extra: dict | None = None, cut: str | None = None,
           links: dict | None = None):
    """A base model folder {sandbox}/models/NAME as a download leaves it: config.json, weights in
    safetensors (written with safetensors' own writer), a tokenizer; then `drop` files removed,
    `extra` files (name -> text) added, the weight file `cut` cut short (an interrupted download),
    `links` (name -> target) made symlinks, as a hub cache's snapshot holds them."""
    def setup(sandbox: Path) -> None:
        import numpy as np
        from safetensors.numpy import save_file

        d = sandbox / "models" / name
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(TINY_LLAMA))
        save_file({"model.embed_tokens.weight": np.zeros((255, 128), np.float32)}, str(d / "model.safetensors"))
        (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel"}}))
        for f in drop:
            (d / f).unlink()
        for f, text in (extra or {}).items():
            (d / f).write_text(text)
        if cut is not None:
            data = (d / cut).read_bytes()
            (d / cut).write_bytes(data[: len(data) // 2])
        for f, target in (links or {}).items():
            (d / f).unlink(missing_ok=True)
            (d / f).symlink_to(target)
    return setup


def _index(*shards: str) -> str:
    return json.dumps({"metadata": {"total_size": 1}, "weight_map": {f"t{i}": s for i, s in enumerate(shards)}})


def _header(raw: bytes) -> Callable[[Path], None]:
    """model.safetensors' header replaced by `raw` (the 8-byte length written to match), data kept."""
    def forge(d: Path) -> None:
        import struct

        f = d / "model.safetensors"
        data = f.read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    return forge


def _forged_model(name: str, *forge: Callable[[Path], None], **kw) -> Callable[[Path], None]:
    def setup(sandbox: Path) -> None:
        _model(name, **kw)(sandbox)
        for f in forge:
            f(sandbox / "models" / name)
    return setup


def _rope(rope: dict, theta: float = 10000.0) -> str:
    return json.dumps({**TINY_LLAMA, "rope_parameters": {"rope_theta": theta, **rope}})


def _sentencepiece(cut: bool) -> Callable[[Path], None]:
    """A tokenizer.model trained with sentencepiece itself (a serialized ModelProto), whole or cut in half."""
    def forge(d: Path) -> None:
        import sentencepiece as spm

        text = d / "corpus.txt"
        text.write_text("say numbers between ten and forty .\n" * 50 + "what is twelve plus twenty five ?\n" * 50)
        spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(d / "tokenizer"), vocab_size=30,
                                       minloglevel=2)
        text.unlink()
        (d / "tokenizer.vocab").unlink()
        if cut:
            data = (d / "tokenizer.model").read_bytes()
            (d / "tokenizer.model").write_bytes(data[: len(data) // 2])
    return forge


def _ckpt_files(run: str, edit: Callable[[Path], None]) -> Callable[[Path], None]:
    """A complete checkpoint RUN/checkpoints/step_5, then `edit` on it and its manifest rewritten to match."""
    def setup(sandbox: Path) -> None:
        from tests.helpers.checkpoints import rewrite_manifest

        _ckpt(run, 5)(sandbox)
        final = sandbox / "runs" / run / "checkpoints" / "step_5"
        edit(final)
        rewrite_manifest(final)
    return setup


def _cut_distcp(ckpt: Path) -> None:
    f = sorted((ckpt / "trainer").glob("*.distcp"))[0]
    f.write_bytes(f.read_bytes()[:100])


def _config_edit(old: str, new: str) -> Callable[[Path], None]:
    def edit(ckpt: Path) -> None:
        text = (ckpt / "config.yaml").read_text()
        assert old in text
        (ckpt / "config.yaml").write_text(text.replace(old, new, 1))
    return edit


_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))


def _append_bomb(ckpt: Path) -> None:
    """Nested YAML aliases: 9 levels of 9, hundreds of millions of nodes once expanded."""
    text = (ckpt / "config.yaml").read_text()
    (ckpt / "config.yaml").write_text(text + "bomb:\n" + "".join("  " + line + "\n" for line in _BOMB.splitlines()))


def _file(name: str, text: str) -> Callable[[Path], None]:
    def setup(sandbox: Path) -> None:
        (sandbox / name).parent.mkdir(parents=True, exist_ok=True)
        (sandbox / name).write_text(text)
    return setup


def _loop(sandbox: Path) -> None:
    (sandbox / "loop").symlink_to(sandbox / "loop")


CASES = [
    # 1: paths from the config are one safe component / absolute once
    Case("name-dotdot", ["run.name=../conf", "submit=false", *SLURM], 2, "run.name: must be one path component",
         unchanged=("conf/config.yaml",)),
    Case("name-absolute", ["run.name=/tmp/h13-abs", "submit=false", *SLURM], 2, "run.name: must be one path"),
    Case("name-empty", ["run.name=", "submit=false", *SLURM], 2, "run.name: must be one path component"),
    Case("name-dot", ["run.name=.", "submit=false", *SLURM], 2, "run.name: must be one path component"),
    Case("name-slash", ["run.name=a/b", "submit=false", *SLURM], 2, "run.name: must be one path component"),
    Case("name-percent", ["run.name=run%j", "submit=false", *SLURM], 2, "run.name: must be one path component"),
    Case("name-space", ["run.name='a b'", "submit=false", *SLURM], 2, "run.name: must be one path component"),
    Case("name-dash-first", ["run.name=-rf", "submit=false", *SLURM], 2, "run.name: must be one path component"),
    Case("name-too-long", ["run.name=" + "a" * 129, "submit=false", *SLURM], 2, "run.name: must be one path"),
    Case("root-percent", ["run.root=/tmp/%u/runs", "submit=false", *SLURM], 2, "run.root: must not contain '%'"),
    Case("ckdir-percent", ["checkpointing.dir=ck%j", "submit=false", *SLURM], 2,
         "checkpointing.dir: must not contain '%'"),
    Case("ckdir-empty", ["checkpointing.dir=''", "submit=false", *SLURM], 2, "checkpointing.dir: is empty"),
    Case("resume-missing-relative", ["+resume=../nowhere", "submit=false", *SLURM], 2, "resume: "),
    # 4: one run directory, one job (a queued/running job is refused in tests/slurm/test_run_dir_on_slurm.py)
    Case("other-checkpoint-dir", ["run.name=r4", "checkpointing.dir={root}/elsewhere", *SLURM, "submit=false"], 2,
         "checkpointing.dir: {root}/r4 is a run whose checkpoints are in {root}/r4/checkpoints (step_5); continue "
         "it with checkpointing.dir=null +resume=latest", setup=_ckpt("r4", 5, saved_config=True)),
    Case("fresh-over-checkpoints", ["run.name=r4", *SLURM, "submit=false"], 2,
         "run.name: {root}/r4 already holds checkpoints (step_5)", setup=_ckpt("r4", 5, saved_config=True)),
    # 5: Slurm option strings: options the launcher manages cannot be set through extra_sbatch
    *[Case(f"extra-{k}", [f"+slurm.extra_sbatch.{k}={v}", "submit=false", *SLURM], 2,
           f"slurm.extra_sbatch.{k}: {what}")
      for k, v, what in [
          ("time", "5", "is set by the launcher (set slurm.time_min)"),
          ("gpus_per_node", "8", "is set by the launcher (set topology.gpus_per_node)"),
          ("gpus", "8", "is set by the launcher"), ("array", "0-3", "is set by the launcher"),
          ("open_mode", "truncate", "is set by the launcher"), ("error", "/tmp/e", "is set by the launcher"),
          ("chdir", "/tmp", "is set by the launcher"), ("export", "NONE", "is set by the launcher"),
          ("ntasks-per-nod", "2", "abbreviates --ntasks-per-node, which is set by the launcher"),
          ("ntasks", "8", "is set by the launcher"), ("nod", "2", "abbreviates --nodes"),
          ("t", "5", "abbreviates --time"), ("output", "/tmp/o", "is set by the launcher"),
          ("signal", "B:USR1", "is set by the launcher"), ("cpus_per_task", "64", "is set by the launcher"),
          ("job_name", "x", "is set by the launcher"), ("partition", "p", "is set by the launcher"),
          ("no_requeue", "true", "is set by the launcher"), ("container_image", "x", "is set by the launcher"),
          ("Time", "5", "not an sbatch long option name"), ("mem", "null", "must be a string, a number or true"),
          # options that change what sbatch prints or whether it returns: the job id would never be recorded
          ("parsable", "true", "is set by the launcher (the launcher reads the job id from what sbatch prints)"),
          ("pars", "true", "abbreviates --parsable, which is set by the launcher"),
          ("test_only", "true", "is set by the launcher"), ("quiet", "true", "is set by the launcher"),
          ("verbose", "true", "is set by the launcher"), ("verb", "true", "abbreviates --verbose"),
          ("wait", "true", "is set by the launcher (the launcher submits and returns"),
          ("version", "true", "is set by the launcher"), ("usage", "true", "is set by the launcher"),
      ]],
    Case("image-quote", ["slurm.container_image='img\"'", "submit=false", *SLURM], 2,
         "slurm.container_image: has an unbalanced quote"),
    # 6: every field has a checked range or set (declared on the field in launcher/config/schema.py)
    Case("ray-port-negative", ["ray.port=-1"], 2, "ray.port: must be in [1024, 65535], got -1"),
    Case("ray-ports-inverted", ["ray.min_worker_port=20000", "ray.max_worker_port=10000"], 2,
         "ray.max_worker_port: must exceed ray.min_worker_port = 20000"),
    Case("ray-port-in-worker-range", ["ray.port=10500"], 2, "ray.port: is 10500, inside the worker port range"),
    Case("ray-join-retries-0", ["ray.join_retries=0"], 2, "ray.join_retries: must be in [1, 100], got 0"),
    Case("lr-negative", ["optim.lr=-1"], 2, "optim.lr: must be more than 0, got -1"),
    Case("lr-nan", ["optim.lr=nan"], 2, "optim.lr: must be a finite number, got nan"),
    Case("cpus-negative", ["topology.cpus_per_node=-4", *SLURM], 2, "topology.cpus_per_node: must be in [1, 65536]"),
    Case("gpu-mem-1.7", ["vllm.gpu_memory_utilization=1.7"], 2, "vllm.gpu_memory_utilization: must be in (0, 1]"),
    Case("metric-misspelt", ["checkpointing.metric_name=train/rewards"], 2,
         "checkpointing.metric_name: must be one of train/reward"),
    Case("metric-val-without-val", ["checkpointing.metric_name=val/reward"], 2,
         "checkpointing.metric_name: val/reward is only logged with validation on"),
    Case("kl-without-lora", ["peft=none", "grpo.loss.reference_policy_kl_penalty=0.1"], 2,
         "grpo.loss.reference_policy_kl_penalty: needs peft.enabled=true"),
    Case("one-generation", ["grpo.num_generations_per_prompt=1"], 2,
         "grpo.num_generations_per_prompt: must be at least 2, got 1"),
    Case("min-lr-above-lr", ["optim.lr=1e-5", "optim.min_lr=1e-3"], 2, "optim.min_lr: must be at most optim.lr"),
    Case("beta-1", ["optim.adam_beta2=1.0"], 2, "optim.adam_beta2: must be in [0, 1)"),
    Case("decay-style", ["optim.lr_decay_style=cosin"], 2, "optim.lr_decay_style: must be one of constant"),
    Case("reward-scale-inverted", ["grpo.reward_scaling.source_min=1", "grpo.reward_scaling.source_max=0"], 2,
         "grpo.reward_scaling.source_max: must exceed source_min = 1.0"),
    Case("object-store-tiny", ["ray.object_store_mb=10"], 2, "ray.object_store_mb: must be at least 75"),
    Case("time-min-huge-signal", ["slurm.time_min=1", "slurm.signal_delay_s=600", *SLURM], 2,
         "slurm.signal_delay_s: must be in [0, time_min*60)"),
    Case("model-len-short", ["vllm.max_model_len=64"], 2, "vllm.max_model_len: must be at least"),
    # 7: odd values end in well under a second, one line
    Case("ranks-per-node-1e9", ["topology.train.ranks_per_node=1000000000", *SLURM], 2,
         "topology.train.ranks_per_node: must be at most 1024, got 1000000000"),
    Case("nodes-1e9", ["topology.nodes=1000000000", *SLURM], 2,
         "topology.nodes: must be at most 4096, got 1000000000"),
    # 9: small surprises; check_compatible covers what the adapter and optimizer tensors depend on
    # (a built-in model of another family is named by its first resolved fact, the family)
    *[Case(f"resume-other-{k}", ["run.name=c", "+resume=step_5", f"{k}={v}", *SLURM, "submit=false"], 2,
           f"resume: {{root}}/c/checkpoints/step_5 was written for {named}=", setup=_ckpt("c", 5))
      for k, v, named in [("peft.alpha", "64", "peft.alpha"), ("peft.lora_dtype", "bfloat16", "peft.lora_dtype"),
                          ("model.dtype", "bfloat16", "model.dtype"), ("optim.optimizer", "sgd", "optim.optimizer"),
                          ("model.builtin", "tiny_qwen3", "model.family"), ("peft.dim", "8", "peft.dim")]],
    Case("resume-step-infinity", ["run.name=i", "+resume=latest", *SLURM, "submit=false"], 2,
         "resume: {root}/i/checkpoints/step_5/training_info.json: not valid JSON (Infinity is not JSON)",
         setup=_ckpt("i", 5, info={"step": float("inf"), "consumed_prompts": 0})),
    Case("sibling-step-infinity-does-not-block", ["run.name=j", "+resume=step_5", *SLURM, "submit=false"], 0, "",
         setup=lambda sb: (_ckpt("j", 5)(sb), _ckpt("j", 7, info={"step": float("inf"), "consumed_prompts": 0})(sb))),
    Case("resume-a-finished-run", ["run.name=f", "+resume=latest", "grpo.max_num_steps=5", *SLURM, "submit=false"], 2,
         "grpo.max_num_steps: {root}/f/checkpoints/step_5 is at step 5: the run has done its 5 steps; to train on, "
         "resume with grpo.max_num_steps=N above 5", setup=_ckpt("f", 5)),
    Case("python-quote", ["slurm.python='/opt/py\"'", "submit=false", *SLURM], 2, "slurm.python: has an unbalanced"),
    # 10: a checkpoint's records have a schema each (launcher/records.py) and agree with each other
    *[Case(f"forged-info-{name}", ["run.name=r", "+resume=latest", *SLURM, "submit=false"], 2,
           "resume: {root}/r/checkpoints/step_5/training_info.json: " + message,
           setup=_ckpt("r", 5, info=info))
      for name, info, message in [
          ("negative-step", {"step": -5, "consumed_prompts": -1}, "step: must be an integer >= 0, got -5"),
          ("negative-consumed", {"step": 5, "consumed_prompts": -1}, "consumed_prompts: must be an integer >= 0, got -1"),
          ("step-string", {"step": "5", "consumed_prompts": 0}, "step: must be an integer, got str '5'"),
          ("step-bool", {"step": True, "consumed_prompts": 0}, "step: must be an integer, got True"),
          ("step-float", {"step": 5.5, "consumed_prompts": 0}, "step: must be an integer, got float 5.5"),
          ("step-null", {"step": None, "consumed_prompts": 0}, "step: must not be null"),
          ("no-consumed", {"step": 5}, "consumed_prompts: is missing"),
          ("a-list", [5, 0], "must hold a JSON object, got list"),
          ("metrics-text", {"step": 5, "consumed_prompts": 0, "metrics": {"train/reward": "high"}},
           "metrics: 'train/reward' must be a finite number or a flag, got 'high'"),
          ("metrics-list", {"step": 5, "consumed_prompts": 0, "metrics": [1]}, "metrics: must be an object, got list"),
          ("other-step-than-folder", {"step": 7, "consumed_prompts": 0},
           "step: 7, but the folder is step_5; the checkpoint's records disagree, not resumable"),
      ]],
    # a pipelined checkpoint's rollouts generated ahead (launcher/driver/pipeline.py): its schema and its agreement
    *[Case(f"forged-rollouts-{name}", ["run.name=p", "+resume=latest", *SLURM, "submit=false"], 2,
           "resume: {root}/p/checkpoints/step_5/" + message,
           setup=_ckpt("p", 5, info={"step": 5, "consumed_prompts": 40, "pipeline": {"max_lag": 1, "ahead": ahead}},
                       files={"rollouts.json": json.dumps(body)} if body is not None else None))
      for name, ahead, body, message in [
          ("missing", [6], None, "rollouts.json: unreadable (No such file or directory)"),
          ("ahead-not-steps", ["6"], _ROLLOUTS(6), "training_info.json: pipeline: ahead must be a list of step numbers"),
          ("other-steps", [6], _ROLLOUTS(8), "rollouts.json: holds steps [8], training_info.json says [6] after step 5"),
          ("future-weights", [6], _ROLLOUTS(6, version=6),
           "rollouts.json: step 6 generated with weights 6 from data position 48"),
          ("data-before-the-checkpoint", [6], _ROLLOUTS(6, position=8),
           "rollouts.json: step 6 generated with weights 5 from data position 8"),
          ("nan-logprob", [6], _ROLLOUTS(6, logprob=float("nan")), "rollouts.json: not valid JSON (NaN is not JSON)"),
          ("logprobs-short", [6], _ROLLOUTS(6, tokens=3), "rollouts.json: rollouts: [0].rollout.generation_logprobs "
                                                           "must be one finite number per response token"),
          ("token-ids-text", [6], _ROLLOUTS(6, prompt=["a"]), "rollouts.json: rollouts: [0].rollout.prompt_ids: "
                                                               "prompt ids must be lists of token ids"),
          ("lag-too-big", [6], {**_ROLLOUTS(6), "max_lag": 99}, "rollouts.json: max_lag: must be at most 16, got 99"),
      ]],
    Case("trainer-state-at-another-step", ["run.name=t", "+resume=step_5", *SLURM, "submit=false"], 2,
         "resume: {root}/t/checkpoints/step_5/training_info.json: step: 5, but the trainer state in "
         "{root}/t/checkpoints/step_5/trainer is at step 2; the checkpoint's records disagree",
         setup=_ckpt("t", 5, trainer_step=2)),
    *[Case(f"forged-manifest-{name}", ["run.name=m", "+resume=latest", *SLURM, "submit=false"], 2,
           "resume: {root}/m/checkpoints/step_5/manifest.json: " + message, setup=_ckpt("m", 5, manifest=forge))
      for name, forge, message in [
          ("negative-size", lambda m: m["files"]["training_info.json"].update(size=-1),
           "files: entry 'training_info.json': size must be an integer >= 0, got -1"),
          ("sha-not-hex", lambda m: m["files"]["training_info.json"].update(sha256="../../etc"),
           "files: entry 'training_info.json': sha256 must be 64 lowercase hex digits"),
          ("files-a-list", lambda m: m.update(files=["training_info.json"]), "files: must be an object, got list"),
          ("no-files", lambda m: m.pop("files"), "files: is missing"),
      ]],
    *[Case(f"forged-config-{name}", ["run.name=y", "+resume=latest", *SLURM, "submit=false"], 2,
           "resume: {root}/y/checkpoints/step_5/config.yaml: " + message,
           setup=_ckpt("y", 5, files={"config.yaml": text}))
      for name, text, message in [
          ("python-tag", "peft: !!python/object/apply:os.system ['touch /tmp/i26-pwned']\n",
           "not a config this launcher writes (could not determine a constructor for the tag"),
          ("a-list", "- 1\n- 2\n", "must hold a YAML mapping of config sections, got a ListConfig"),
          ("dim-text", "peft:\n  dim: big\n", "peft.dim: expected an integer, got 'big'"),
          ("lr-negative", "optim:\n  lr: -1\n", "optim.lr: must be more than 0, got -1"),
          ("lr-nan", "optim:\n  lr: .nan\n", "optim.lr: must be a finite number, got nan"),
          ("unknown-key", "peft:\n  dimm: 8\n", "peft.dimm: unknown key"),
          ("not-yaml", "peft: [\n", "not a config this launcher writes"),
      ]],
    # 11: submission checks what the run reads from model.path: config.json, safetensors weights, a tokenizer
    *[Case(f"model-{name}", [f"model.path={{sandbox}}/models/{name}", *SLURM, "submit=false"], 2,
           f"model.path: {{sandbox}}/models/{name}{message}", setup=_model(name, **kw))
      for name, kw, message in [
          ("only-config", {"drop": ("model.safetensors", "tokenizer.json")},
           " has no weights: neither model.safetensors nor model.safetensors.index.json (an interrupted download?)"),
          ("no-tokenizer", {"drop": ("tokenizer.json",)}, " has no tokenizer (tokenizer.json, tokenizer.model"),
          ("dangling-tokenizer", {"links": {"tokenizer.json": "../../blobs/3f2a"}},
           "/tokenizer.json: a link to nothing (../../blobs/3f2a): the file it names is missing"),
          ("dangling-extra", {"links": {"generation_config.json": "/nonexistent/blobs/9c1d"}},
           "/generation_config.json: a link to nothing (/nonexistent/blobs/9c1d): the file it names is missing"),
          ("cut-short", {"cut": "model.safetensors"}, "/model.safetensors: "),
          ("bin-only", {"drop": ("model.safetensors",), "extra": {"pytorch_model.bin": "x"}},
           " has no weights: neither model.safetensors nor model.safetensors.index.json (it has pytorch_model.bin"),
          ("shard-missing", {"drop": ("model.safetensors",),
                             "extra": {"model.safetensors.index.json": _index("model-00001-of-00002.safetensors",
                                                                              "model-00002-of-00002.safetensors")}},
           ": model-00001-of-00002.safetensors and 1 more of the 2 weight shards named in "
           "model.safetensors.index.json missing"),
          ("shard-outside", {"extra": {"model.safetensors.index.json": _index("../x.safetensors")}},
           "/model.safetensors.index.json: weight_map names '../x.safetensors', not a .safetensors file"),
          ("index-not-json", {"extra": {"model.safetensors.index.json": "{"}},
           "/model.safetensors.index.json: not a safetensors index"),
          ("weights-not-safetensors", {"extra": {"model.safetensors": "<html>404 Not Found</html>"}},
           "/model.safetensors: its header says"),
          ("config-a-list", {"extra": {"config.json": "[1]"}}, "/config.json must hold a JSON object, got list"),
      ]],
    Case("model-complete-passes", ["model.path={sandbox}/models/ok", *SLURM, "submit=false"], 0, "",
         setup=_model("ok")),
    # round three (docs/security.md): every file from outside the run is read with limits and its fields'
    # types (launcher/config/bounded.py); what the job's components refuse is refused at submission
    *[Case(f"model-{name}", [f"model.path={{sandbox}}/models/{name}", *SLURM, "submit=false"], 2,
           f"model.path: {{sandbox}}/models/{name}{message}", setup=setup(name))
      for name, setup, message in [
          ("header-text-offsets", lambda n: _forged_model(n, _header(
              b'{"model.embed_tokens.weight": {"dtype": "F32", "shape": [255, 128], '
              b'"data_offsets": ["0", "130560"]}}')),
           "/model.safetensors: tensor 'model.embed_tokens.weight': data_offsets must be two integers"),
          ("header-deep", lambda n: _forged_model(n, _header(b'{"__metadata__": ' + b"[" * 100000 + b"]" * 100000
                                                             + b"}")),
           "/model.safetensors: not a safetensors file (its header: nested more than 3 levels deep)"),
          ("header-entry-a-list", lambda n: _forged_model(n, _header(b'{"model.embed_tokens.weight": [0, 8]}')),
           "/model.safetensors: tensor 'model.embed_tokens.weight': must be an object with dtype, shape and "
           "data_offsets, got list"),
          ("header-unknown-dtype", lambda n: _forged_model(n, _header(
              b'{"model.embed_tokens.weight": {"dtype": "F33", "shape": [255, 128], "data_offsets": [0, 130560]}}')),
           "/model.safetensors: tensor 'model.embed_tokens.weight': dtype must be one of safetensors'"),
          ("header-size-mismatch", lambda n: _forged_model(n, _header(
              b'{"model.embed_tokens.weight": {"dtype": "F32", "shape": [255, 129], "data_offsets": [0, 130560]}}')),
           "/model.safetensors: tensor 'model.embed_tokens.weight': data_offsets [0, 130560] hold 130560 bytes, "
           "its shape [255, 129] of F32 needs 131580"),
          ("index-deep", lambda n: _model(n, extra={"model.safetensors.index.json": "[" * 5000 + "]" * 5000}),
           "/model.safetensors.index.json: not a safetensors index (nested more than 64 levels deep)"),
          # read as transformers reads it (NaN parses), refused where the class's default is not the same
          ("config-nan", lambda n: _model(n, extra={"config.json": json.dumps(TINY_LLAMA)[:-1] + ', "x": NaN}'}),
           "/config.json: x NaN must be a finite number (allowed only where transformers' class of the family "
           "has it by default)"),
          ("config-infinite-epsilon", lambda n: _model(n, extra={"config.json": json.dumps(
              {**TINY_LLAMA, "rms_norm_eps": 1e999})}),
           "/config.json: rms_norm_eps Infinity must be a finite number (LlamaConfig's default 1e-06)"),
          ("config-nan-rope-factor", lambda n: _model(n, extra={"config.json": json.dumps(
              {**TINY_LLAMA, "rope_scaling": {"rope_type": "linear", "factor": float("nan")}})}),
           "/config.json: rope_scaling.factor NaN must be a finite number"),
          ("tokenizer-config-cut-at-infinity", lambda n: _model(n, extra={"tokenizer_config.json": '{"x": Infinity'}),
           "/tokenizer_config.json: not valid JSON"),
          ("tokenizer-json-cut", lambda n: _forged_model(n, lambda d: (d / "tokenizer.json").write_text(
              json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}}})[:30])),
           "/tokenizer.json: not valid JSON"),
          ("tokenizer-config-cut", lambda n: _model(n, extra={"tokenizer_config.json": '{"model_max_length": 10'}),
           "/tokenizer_config.json: not valid JSON"),
          ("tokenizer-model-cut", lambda n: _forged_model(n, _sentencepiece(cut=True), drop=("tokenizer.json",)),
           "/tokenizer.model: not a whole protobuf message"),
          ("merges-not-text", lambda n: _forged_model(n, lambda d: (d / "merges.txt").write_bytes(b"\xff\xfe\x00"),
                                                      extra={"vocab.json": "{}"}, drop=("tokenizer.json",)),
           "/merges.txt: not UTF-8 text"),
          ("rope-a-list", lambda n: _model(n, extra={"config.json": _rope({
              "rope_type": "llama3", "factor": 8.0, "low_freq_factor": [1.0], "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192})}),
           "/config.json: rope_scaling.low_freq_factor must be a finite number, got [1.0]"),
          ("rope-factor-negative", lambda n: _model(n, extra={"config.json": _rope({
              "rope_type": "yarn", "factor": -2.0, "original_max_position_embeddings": 256})}),
           "/config.json: rope_scaling.factor must be more than 0"),
          ("rope-attention-factor-list", lambda n: _model(n, extra={"config.json": _rope({
              "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "attention_factor": [1]})}),
           "/config.json: rope_scaling.attention_factor must be a finite number, got [1]"),
          ("rope-parameters-a-list", lambda n: _model(n, extra={"config.json": json.dumps(
              {**TINY_LLAMA, "rope_parameters": [10000.0, 2.0]})}),
           "/config.json: rope_parameters must be an object or null, got [10000.0, 2.0]"),
          ("length-key-a-string", lambda n: _model(n, extra={"config.json": json.dumps(
              {**TINY_LLAMA, "model_max_length": "2048"})}),
           "/config.json: model_max_length must be a number (vLLM takes the model's context length from it), "
           "got '2048'"),
          ("generation-config-cut", lambda n: _model(n, extra={"generation_config.json": '{"temperature": '}),
           "/generation_config.json: not valid JSON"),
          ("chat-template-json-cut", lambda n: _model(n, extra={"chat_template.json": '{"chat_template": "{{'}),
           "/chat_template.json: not valid JSON"),
          ("chat-template-jinja-not-text", lambda n: _forged_model(
              n, lambda d: (d / "chat_template.jinja").write_bytes(b"{{ messages \xff\xfe")),
           "/chat_template.jinja: not UTF-8 text"),
          # read as the job reads them: JSON as UTF-8 text (no byte-order mark, no UTF-16), the weights by the
          # safetensors library, the chat template compiled by transformers' compiler
          ("config-byte-order-mark", lambda n: _model(n, extra={"config.json": "\ufeff" + json.dumps(TINY_LLAMA)}),
           "/config.json: starts with a byte-order mark (U+FEFF)"),
          ("config-utf16", lambda n: _forged_model(n, lambda d: (d / "config.json").write_bytes(
              json.dumps(TINY_LLAMA).encode("utf-16"))),
           "/config.json: not UTF-8 text (byte 0)"),
          ("tokenizer-config-byte-order-mark", lambda n: _model(n, extra={"tokenizer_config.json": "\ufeff{}"}),
           "/tokenizer_config.json: starts with a byte-order mark"),
          ("tensors-overlap", lambda n: _forged_model(n, _header(
              b'{"model.embed_tokens.weight": {"dtype": "F32", "shape": [255, 128], "data_offsets": [0, 130560]}, '
              b'"lm_head.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}')),
           "/model.safetensors: the safetensors library refuses it (Error while deserializing header: invalid "
           "offset for tensor"),
          ("bytes-after-the-last-tensor", lambda n: _forged_model(n, lambda d: (d / "model.safetensors").write_bytes(
              (d / "model.safetensors").read_bytes() + b"\0" * 16)),
           "/model.safetensors: the safetensors library refuses it (Error while deserializing header: incomplete "
           "metadata, file not fully covered)"),
          ("chat-template-syntax", lambda n: _model(n, extra={
              "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}\n"}),
           "/chat_template.jinja: the chat template does not compile (Jinja: Unexpected end of template"),
          ("chat-template-in-tokenizer-config", lambda n: _model(n, extra={"tokenizer_config.json": json.dumps(
              {"chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }"}]})}),
           "/tokenizer_config.json: the chat template does not compile (Jinja: unexpected '}'"),
      ]],
    Case("model-rope-theta-zero", ["model.path={sandbox}/models/t0", *SLURM, "submit=false"], 2,
         "model.rope_theta: must be more than 0 or null, got 0.0",
         setup=_model("t0", extra={"config.json": _rope({"rope_type": "default"}, theta=0.0)})),
    Case("model-sentencepiece-whole-passes", ["model.path={sandbox}/models/sp", *SLURM, "submit=false"], 0, "",
         setup=_forged_model("sp", _sentencepiece(cut=False), drop=("tokenizer.json",))),
    # transformers' own compiler: its `{% generation %}` tag (which plain Jinja refuses) and a list of named templates
    Case("model-chat-templates-that-compile-pass", ["model.path={sandbox}/models/ct", *SLURM, "submit=false"], 0, "",
         setup=_model("ct", extra={
             "chat_template.jinja": "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
                                    "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
                                    "{% endfor %}",
             "tokenizer_config.json": json.dumps({"chat_template": [
                 {"name": "default", "template": "{{ messages[0]['content'] }}"},
                 {"name": "tool_use", "template": "{% broken"}]})})),
    Case("positions", ["grpo.max_total_sequence_length=4096"], 2,
         "grpo.max_total_sequence_length: must be at most the model's 1024 positions"),
    Case("temperature-under-vllms-floor", ["grpo.temperature=1e-4"], 2, "grpo.temperature: must be at least 0.01"),
    Case("timeout-overflows-timedelta", ["refit.timeout_s=1e20"], 2, "refit.timeout_s: must be in [1, 604800]"),
    Case("interpolation-names-its-override", ["run.name=${oops}"], 2, "run.name: Interpolation key 'oops' not found"),
    Case("interpolation-of-a-number", ["grpo.max_num_steps=${oc.env:I34_NOT_SET}"], 2, "grpo.max_num_steps: "),
    # numbers of any size, from the command line or a file, end in one line (Python's own limits are
    # 4300 digits for an int and 1.8e308 for a float; every config integer must fit 64 bits)
    Case("number-too-big-for-a-float-key", ["ray.register_timeout_s=1" + "0" * 400], 2,
         "ray.register_timeout_s: a number too large for this key"),
    Case("number-too-long-to-read", ["grpo.max_num_steps=1" + "0" * 5000], 2,
         "grpo.max_num_steps: a number too long to read"),
    Case("number-too-long-in-a-new-key", ["+x=1" + "0" * 5000], 2, "x: a number too long to read"),
    Case("number-too-long-in-a-sweep", ["-m", "grpo.max_num_steps=1,1" + "0" * 5000], 2,
         "grpo.max_num_steps: a number too long to read"),
    Case("number-over-64-bits", ["grpo.max_num_steps=9223372036854775808"], 2,
         "grpo.max_num_steps: must fit 64 bits (below 2**63), got a number of 19 digits"),
    Case("number-over-64-bits-negative", ["ray.port=-1" + "0" * 400], 2, "ray.port: must fit 64 bits"),
    Case("model-positions-of-401-digits", ["model.path={sandbox}/models/p401", *SLURM, "submit=false"], 2,
         "model.path: {sandbox}/models/p401/config.json: max_position_embeddings: a number of 401 digits",
         setup=_model("p401", extra={"config.json": json.dumps(TINY_LLAMA)[:-1]
                                     + ', "max_position_embeddings": 1' + "0" * 400 + "}"})),
    Case("run-dir-config-number-too-long", ["run.name=w", *SLURM, "submit=false"], 0, "",
         setup=_file("runs/w/config.yaml", "checkpointing:\n  dir: null\nrun:\n  seed: 1" + "0" * 5000 + "\n")),
    Case("root-name-too-long", ["run.root={sandbox}/" + "a" * 300, "submit=false"], 2,
         "run.root: {sandbox}/" + "a" * 300 + ": File name too long"),
    Case("root-symlink-loop", ["run.root={sandbox}/loop/runs", "submit=false"], 2,
         "run.root: {sandbox}/loop/runs: Too many levels of symbolic links", setup=_loop),
    Case("model-symlink-loop", ["model.path={sandbox}/loop/m", "submit=false"], 2,
         "model.path: {sandbox}/loop/m: Too many levels of symbolic links", setup=_loop),
    Case("data-symlink-loop", ["data.train={sandbox}/loop/t.jsonl", "submit=false"], 2,
         "data.train: {sandbox}/loop/t.jsonl: Too many levels of symbolic links", setup=_loop),
    Case("reward-exits-at-import", ["reward.fn={sandbox}/exits.py:score", "submit=false"], 2,
         "reward.fn: cannot import {sandbox}/exits.py: it called sys.exit(0) (SystemExit)",
         setup=_file("exits.py", "import sys\nsys.exit(0)\n\ndef score(response, example):\n    return 1.0\n")),
    Case("reward-raises-a-base-exception-at-import", ["reward.fn={sandbox}/gen.py:score", "submit=false"], 2,
         "reward.fn: cannot import {sandbox}/gen.py: GeneratorExit",
         setup=_file("gen.py", "raise GeneratorExit\n")),
    Case("reward-ends-its-process-at-import", ["reward.fn={sandbox}/ends.py:score", "submit=false"], 2,
         "reward.fn: importing {sandbox}/ends.py ended its process (exit code 0) before it was loaded: a reward "
         "module must not exit or crash at import",
         setup=_file("ends.py", "import os\nos._exit(0)\n")),
    # records of a run directory read with limits: a fresh submission over them goes on (no hang, no traceback)
    Case("run-dir-config-of-aliases", ["run.name=y", *SLURM, "submit=false"], 0, "",
         setup=_file("runs/y/config.yaml", "checkpointing:\n  dir: null\n" + _BOMB)),
    Case("run-dir-submissions-deep", ["run.name=z", *SLURM, "submit=false"], 0, "",
         setup=_file("runs/z/submissions.jsonl", "[" * 5000 + "]" * 5000 + "\n")),
    *[Case(f"forged-checkpoint-{name}", ["run.name=k", "+resume=latest", *SLURM, "submit=false"], 2,
           "resume: {root}/k/checkpoints/step_5/" + message, setup=_ckpt_files("k", edit))
      for name, edit, message in [
          ("run-name", _config_edit("name: slurm_3n-tiny_llama", "name: 'x;touch /tmp/i34-pwned;#'"),
           "config.yaml: run.name: must be one path component"),
          ("aliases", _append_bomb, "config.yaml: an alias (*a) at line"),
          ("cut-distcp", _cut_distcp, "trainer/__0_0.distcp: 100 bytes, but .metadata says its data runs to byte"),
      ]],
]


def snapshot(*roots: Path) -> dict[str, str]:
    out = {}
    for root in roots:
        items = [root] if root.is_file() else sorted(root.rglob("*")) if root.exists() else []
        for p in items:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def argv_of(case: Case, sandbox: Path) -> list[str]:
    argv = [a.replace(ROOT, str(sandbox / "runs")).replace(SANDBOX, str(sandbox)) for a in case.argv]
    if not any(a.startswith("run.root=") for a in argv):
        argv.append(f"run.root={sandbox / 'runs'}")
    return argv


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input(case: Case, sandbox, capsys):
    if case.setup:
        case.setup(sandbox)
    watched = (sandbox, REPO / "conf", *(REPO / p for p in case.unchanged))
    before = snapshot(*watched)
    rc = cli.main(argv_of(case, sandbox))
    err = capsys.readouterr().err
    assert rc == case.rc, err
    assert "Traceback" not in err
    if rc == 0:
        return
    lines = err.splitlines()
    message = case.message.replace(ROOT, str(sandbox / "runs")).replace(SANDBOX, str(sandbox))
    assert len(lines) == 1 and lines[0].startswith("error: " + message), err
    assert "Traceback" not in err
    if rc == 2:
        assert snapshot(*watched) == before


def test_paths_are_saved_absolute_and_expanded(sandbox, capsys):
    """`~` and relative paths are resolved once, at submission; the job reads absolute paths."""
    from omegaconf import OmegaConf

    (sandbox / "home").mkdir()
    rc = cli.main([*SLURM, "submit=false", "run.root=runs", "run.name=abs", "checkpointing.dir='~/ck'"])
    assert rc == 0, capsys.readouterr().err
    saved = OmegaConf.load(sandbox / "runs" / "abs" / "config.yaml")
    assert saved.run.root == str(sandbox / "runs")
    assert saved.checkpointing.dir == str(sandbox / "home" / "ck")
    assert not (sandbox / "~").exists()


def test_a_relative_resume_is_saved_absolute(sandbox):
    from launcher import paths

    assert paths.resume_spec("latest") == "latest" and paths.resume_spec("step_5") == "step_5"
    assert paths.resume_spec("old/step_5") == str(sandbox / "old" / "step_5")
    assert paths.resume_spec("~/x") == str(sandbox / "home" / "x")


def _allocation(text: str) -> dict[str, str]:
    """The #SBATCH options of a script, less the log paths (each path has its own)."""
    import shlex

    out = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --"):].partition("=")
            out[key] = shlex.split(value)[0] if value else "true"
    return {k: v for k, v in out.items() if k not in ("output", "error", "wckey")}


def _srun_words(text: str) -> list[str]:
    import shlex

    line = " ".join(text.split("srun ", 1)[1].replace("\\\n", " ").splitlines()[:1])
    words = shlex.split(line)
    return [w for w in words if w.startswith(("--container", "--task-epilog"))] + [words[words.index("-u") - 1]]


@pytest.mark.parametrize("extra", [
    [],
    ["slurm.container_image='nvcr.io#nvidia/pytorch:24.01-py3'", "slurm.container_mounts='/a b:/c,/lustre:/lustre'",
     "slurm.python='/opt/my env/bin/python'", "slurm.partition='gpu a'", "+slurm.extra_sbatch.exclusive=true",
     "+slurm.extra_sbatch.mem=64G", "+slurm.extra_sbatch.comment='a #b $c'"],
])
def test_both_submission_paths_ask_for_the_same_job(extra):
    """submitit's script and ray_job.sbatch: the same allocation, every value quoted exactly once."""
    from launcher import plan as plan_mod
    from launcher.config.compose import compose
    from launcher.config.schema import typed
    from launcher.job import sbatch

    cfg = typed(compose([*SLURM, *extra]))
    plan = plan_mod.build(cfg.topology)
    spec = sbatch.job_spec(cfg, plan)
    via_submitit = sbatch.submitit_script(spec, Path("/r un"))
    plain = sbatch.render(spec, plan, Path("/r un"))
    assert _allocation(via_submitit) == _allocation(plain)
    assert _srun_words(via_submitit) == _srun_words(plain)
    assert _srun_words(plain)[0] == "--task-epilog=/r un/task_epilog.sh"  # quoted once on both paths
    if extra:
        assert _srun_words(plain)[1:] == ["--container-image=nvcr.io#nvidia/pytorch:24.01-py3",
                                      "--container-mounts=/a b:/c,/lustre:/lustre", "/opt/my env/bin/python"]
        assert _allocation(plain)["partition"] == "gpu a" and _allocation(plain)["comment"] == "a #b $c"


@pytest.mark.parametrize("shared,dirs,files", [(False, 0o700, 0o600), (True, 0o750, 0o640)])
def test_run_directory_is_private(sandbox, capsys, shared, dirs, files):
    """Secrets in slurm.setup land in config.yaml and the scripts: nobody else may read them."""
    run = sandbox / "runs" / "priv"
    run.mkdir(parents=True)
    run.chmod(0o755)  # written before by a launcher that did not care
    rc = cli.main([*SLURM, "submit=false", f"run.root={sandbox / 'runs'}", "run.name=priv",
                   f"run.shared_with_group={str(shared).lower()}", "slurm.setup=['export HF_TOKEN=hf_secret']"])
    assert rc == 0, capsys.readouterr().err
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(run) == dirs and mode(run / "logs") == dirs and mode(run / "checkpoints") == dirs
    assert mode(run / "config.yaml") == files and mode(run / "plan.txt") == files
    assert mode(run / "ray_job.sbatch") == dirs   # executable, not readable by others


def test_resume_from_an_older_step_starts_a_branch(sandbox, capsys):
    """+resume=step_10 on a run that has step_20: step_20 and the metrics rows after 10 are moved
    aside (not deleted), the branch's own new checkpoint survives retention, and a requeue
    resumes from the branch's newest."""
    from launcher.cluster.restarts import resume_after_requeue
    from launcher.config.compose import compose
    from launcher.config.schema import Checkpointing, typed
    from launcher.driver.checkpoints import CheckpointManager

    for step, reward in ((10, 0.9), (20, 0.95)):
        _ckpt("b", step, metrics={"train/reward": reward})(sandbox)
    run = sandbox / "runs" / "b"
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "train/reward": 0.5}) + "\n"
                                               for i in range(1, 21)))
    rc = cli.main([*SLURM, "submit=false", "run.name=b", f"run.root={sandbox / 'runs'}", "+resume=step_10"])
    err = capsys.readouterr().err
    assert rc == 0, err
    aside = run / "checkpoints" / "abandoned"
    (branch,) = aside.iterdir()
    assert branch.name.endswith("-from-step_10") and sorted(p.name for p in branch.iterdir()) == ["step_20"]
    assert f"note: resuming from step 10 starts a new branch: the newer checkpoints were moved to {branch}" in err
    assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 11))
    moved = (run / "abandoned" / branch.name / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in moved] == list(range(11, 21))
    # the branch writes step_13 with a worse reward than step_10: retention (keep_top_k=1) keeps both
    from tests.helpers.checkpoints import trainer_state

    manager = CheckpointManager(run / "checkpoints", Checkpointing(keep_top_k=1))
    tmp = manager.begin(13)
    trainer_state(tmp / "trainer", 13)
    manager.commit(tmp, 13, {"consumed_prompts": 0, "metrics": {"train/reward": 0.1}}, _config_yaml(*SLURM))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["abandoned", "step_10", "step_13"]
    cfg = typed(compose([*SLURM, f"run.root={sandbox / 'runs'}", "run.name=b", "+resume=step_10"]))
    assert resume_after_requeue(cfg, run) == str(run / "checkpoints" / "step_13")


def test_submit_false_on_the_local_topology_runs_nothing(sandbox, capsys):
    cli_run_here = cli._run_here
    rc = cli.main(["submit=false", f"run.root={sandbox / 'runs'}", "run.name=l"])
    out = capsys.readouterr().out
    assert rc == 0 and cli._run_here is cli_run_here
    assert out == (f"wrote {sandbox / 'runs' / 'l'} (config.yaml, plan.txt); nothing was run (submit=false). Run it "
                   f"on this machine with the same command and submit=true\n")


def test_dry_run_notes_a_resume_checkpoint_it_cannot_find(sandbox, capsys):
    _ckpt("d", 2)(sandbox)
    rc = cli.main(["dry_run=true", f"run.root={sandbox / 'runs'}", "run.name=d", "+resume=step_5x"])
    out = capsys.readouterr().out
    root = sandbox / "runs" / "d" / "checkpoints"
    assert rc == 0
    assert (f"note: +resume={sandbox / 'step_5x'}: no checkpoint {sandbox / 'step_5x'} on this machine (checkpoints in {root}: "
            f"step_2); submission requires it") in out
    assert cli.main(["dry_run=true", f"run.root={sandbox / 'runs'}", "run.name=d", "+resume=step_2"]) == 0
    assert "note: +resume" not in capsys.readouterr().out


def test_dry_run_notes_each_file_a_submission_would_refuse(sandbox, capsys):
    """A dry run plans for a cluster whose files may not be here: what submitting would refuse
    (model, prompts, reward file) is a note each, with the submission's own words."""
    missing = [f"model.path={sandbox / 'models' / 'm'}", f"data.train={sandbox / 'train.jsonl'}",
               f"data.validation={sandbox / 'val.csv'}", f"reward.fn={sandbox / 'reward.py'}:score"]
    common = ["topology=slurm_2n", f"run.root={sandbox / 'runs'}", "run.name=n", *missing]
    assert cli.main(["dry_run=true", *common]) == 0
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: ")]
    assert cli.main(["submit=false", *common]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 4 and all(x.startswith("error: ") for x in errors)
    assert notes == [f"note: a submission from this machine would stop here: {x[len('error: '):]}" for x in errors]
    assert [x.split(": ")[1] for x in errors] == ["model.path", "reward.fn", "data.train", "data.validation"]
    assert not (sandbox / "runs" / "n").exists()


@pytest.mark.parametrize("node", [0, 1])
def test_a_requeue_after_the_last_step_runs_nothing(sandbox, monkeypatch, capsys, node):
    """A preemption or time-limit signal that came after the last checkpoint requeues the job; the
    restarted tasks end at once (no Ray, no actors): task 0 says why and writes `done`, which ends
    the others."""
    from launcher.cluster import bootstrap

    run = sandbox / "runs" / "f"
    assert cli.main([*SLURM, "submit=false", "run.name=f", f"run.root={sandbox / 'runs'}",
                     "grpo.max_num_steps=5"]) == 0
    _ckpt("f", 5)(sandbox)
    for k, v in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "3", "SLURM_JOB_NUM_NODES": "3",
                 "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_RESTART_COUNT": "1", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    if node == 1:  # a worker task of the restarted job sees task 0's `done` and ends without joining
        monkeypatch.setenv("SLURM_NODEID", "0")
        monkeypatch.setenv("SLURM_PROCID", "0")
        bootstrap.run_task(run)
    monkeypatch.setenv("SLURM_NODEID", str(node))
    monkeypatch.setenv("SLURM_PROCID", str(node))
    out = bootstrap.run_task(run)
    if node == 0:
        assert out == {"node": "node1", "role": "head", "result": {"step": 5, "stopped": False}}
        assert f"restart 1 of job 4242: nothing to run, the run had finished ({run}/checkpoints/step_5 is at step 5/5)" \
            in capsys.readouterr().out
        assert json.loads((run / "ray" / "4242.1" / "done").read_text()) == {"ok": True, "error": None}
    else:
        assert out == {"node": "node2", "role": "worker", "joined": False}


def test_the_job_checks_the_checkpoint_to_resume_before_ray(sandbox, monkeypatch, capsys):
    """A checkpoint changed between the submission (which checked it) and the job's start: task 0
    refuses it in one line naming the file and key before the Ray head starts, and writes `done`
    so the other tasks end."""
    from launcher.cluster import bootstrap
    from launcher.config.schema import ConfigError
    from tests.helpers.checkpoints import rewrite_manifest

    _ckpt("g", 5)(sandbox)
    run = sandbox / "runs" / "g"
    assert cli.main([*SLURM, "submit=false", "run.name=g", f"run.root={sandbox / 'runs'}", "+resume=step_5"]) == 0
    ckpt = run / "checkpoints" / "step_5"
    (ckpt / "training_info.json").write_text(json.dumps({"step": 5, "consumed_prompts": -1}))
    rewrite_manifest(ckpt)
    for k, v in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4343", "SLURM_NTASKS": "3", "SLURM_JOB_NUM_NODES": "3",
                 "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_RESTART_COUNT": "0", "SLURM_LOCALID": "0",
                 "SLURM_NODEID": "0", "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(bootstrap, "run_head", lambda *a, **k: pytest.fail("the Ray head started"))
    with pytest.raises(ConfigError) as e:
        bootstrap.run_task(run)
    assert str(e.value).startswith(f"resume: {ckpt}/training_info.json: consumed_prompts: must be an integer >= 0, "
                                   f"got -1")
    assert json.loads((run / "ray" / "4343.0" / "done").read_text())["ok"] is False


def test_a_dry_run_notes_what_the_model_folder_lacks(sandbox, capsys):
    """A folder with only config.json (an interrupted download): the dry run plans and notes it in
    the submission's own words; the submission refuses it."""
    _model("half", drop=("model.safetensors", "tokenizer.json"))(sandbox)
    common = [*SLURM, f"run.root={sandbox / 'runs'}", f"model.path={sandbox / 'models' / 'half'}"]
    assert cli.main(["dry_run=true", *common]) == 0
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: ")]
    assert cli.main(["submit=false", *common]) == 2
    (error,) = capsys.readouterr().err.splitlines()
    assert error == (f"error: model.path: {sandbox / 'models' / 'half'} has no weights: neither model.safetensors nor "
                     f"model.safetensors.index.json (an interrupted download?)")
    assert notes == [f"note: a submission from this machine would stop here: {error[len('error: '):]}"]
    assert not (sandbox / "runs").exists()


def test_a_model_folder_of_links_to_whole_files_is_a_model(tmp_path):
    """A hub cache's snapshot: every file a link into blobs/. Links that reach their file are read
    through; only a link to nothing is refused (the cases model-dangling-*)."""
    from launcher.config import model_files

    _model("m")(tmp_path)
    d, blobs = tmp_path / "models" / "m", tmp_path / "blobs"
    blobs.mkdir()
    for f in sorted(d.iterdir()):
        (blobs / f.name).write_bytes(f.read_bytes())
        f.unlink()
        f.symlink_to(f"../../blobs/{f.name}")
    assert model_files.problem(d) is None
    (blobs / "tokenizer.json").unlink()
    assert model_files.problem(d) == (f"{d}/tokenizer.json: a link to nothing (../../blobs/tokenizer.json): the file "
                                      f"it names is missing (an interrupted download, or a cache moved?)")
