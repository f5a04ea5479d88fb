"""What the job checks when it starts is what the launcher checks at submission: both ways, same inputs.

Each case is a config (overrides) and the files it reads (a checkpoint to resume, a model folder).
The launcher's way: `python -m launcher ... submit=false` (cli.main), its exit code and its one
line. The job's way: the run directory's config.yaml as a submission writes it (written here when
the launcher refused, as a hand-edited or plain-sbatch run directory would hold it), then task 0 of
the Slurm job (launcher.cluster.bootstrap.run_task) with the Ray head replaced by a sentinel: it
must refuse with the same line before Ray starts, or reach the sentinel when the launcher accepted.
A resume the launcher accepts is one the job accepts; the hint of a refusal, applied, passes both.
launcher/driver/start_check.py is the one function both run; tests/unit/test_job_limits.py checks
its rules against the job's components themselves (vLLM's functions, megatron's scheduler).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher import __main__ as cli
from tests.unit.test_hostile_inputs import SLURM, TINY_LLAMA, _ckpt, _model

STARTED = {"role": "head", "started": True}


def _rollouts(rows: int = 64, tokens: int = 2, lag: int = 1, ahead: int = 1, version: int = 5,
              sampling: dict | None = None) -> dict:
    """rollouts.json as the driver writes it for a pipelined checkpoint at step 5 (launcher.driver.pipeline.save):
    `ahead` steps of `rows` samples, with the sampling settings of the checkpoint's config."""
    from launcher.config.compose import compose
    from launcher.config.schema import typed
    from launcher.driver.pipeline import sampling_settings

    settings = sampling if sampling is not None else json.loads(json.dumps(sampling_settings(typed(compose(SLURM)))))
    return {"max_lag": lag, "sampling": settings, "rollouts": [
        {"step": 6 + i, "version": version + i, "position": 48 + 8 * i, "metrics": {}, "refit": {},
         "rollout": {"prompt_ids": [[1, 2]] * rows, "response_ids": [[3, 4][:tokens] + [5] * (tokens - 2)] * rows,
                     "generation_logprobs": [[-0.5] * tokens] * rows, "rewards": [1.0] * rows,
                     "texts": ["x"] * rows, "truncated": [False] * rows, "reward_errors": 0}}
        for i in range(ahead)]}


def _pipelined(run: str, body: dict, lag: int = 1):
    steps = [r["step"] for r in body["rollouts"]]
    return _ckpt(run, 5, info={"step": 5, "consumed_prompts": 40, "pipeline": {"max_lag": lag, "ahead": steps}},
                 files={"rollouts.json": json.dumps(body)})


def _rope_model(name: str, rope: dict):
    """A model folder whose config.json asks for `rope` (rope_parameters, transformers 5's spelling)."""
    return _model(name, extra={"config.json": json.dumps({**TINY_LLAMA, "rope_parameters": {"rope_theta": 10000.0,
                                                                                             **rope}})})


def _messages(sandbox: Path) -> None:
    (sandbox / "m.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "say 4 ."}], "answer": "4"})
                                     + "\n")


CASES = [  # (name, overrides, setup, the start of the launcher's line after "error: ", or "" when it accepts)
    ("plain", [], None, ""),
    ("positions", ["grpo.max_total_sequence_length=2048"], None,
     "grpo.max_total_sequence_length: must be at most the model's 1024 positions (max_position_embeddings of model "
     "tiny_llama; vLLM refuses a longer context at engine start), got 2048"),
    ("temperature-floor", ["grpo.temperature=0.001"], None, "grpo.temperature: must be at least 0.01 (vLLM raises"),
    ("timeout-overflow", ["ray.register_timeout_s=1e20"], None, "ray.register_timeout_s: must be in (0, 604800]"),
    ("warmup-past-decay", ["optim.lr_warmup_iters=40"], None,
     "optim.lr_warmup_iters: must be less than the decay steps (grpo.max_num_steps = 40)"),
    ("wsd-without-steps", ["optim.lr_decay_style=WSD"], None, "optim.lr_decay_style: WSD needs megatron's"),
    ("rope-factor-zero", ["model.path={sandbox}/models/r0"], _rope_model("r0", {"rope_type": "yarn", "factor": 0}),
     "model.path: {sandbox}/models/r0/config.json: rope_scaling.factor must be more than 0"),
    ("rope-factor-list", ["model.path={sandbox}/models/rl"],
     _rope_model("rl", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": [1.0], "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}),
     "model.path: {sandbox}/models/rl/config.json: rope_scaling.low_freq_factor must be a finite number, got [1.0]"),
    ("length-key-not-a-number", ["model.path={sandbox}/models/ml"],
     _model("ml", extra={"config.json": json.dumps({**TINY_LLAMA, "max_seq_len": "4k"})}),
     "model.path: {sandbox}/models/ml/config.json: max_seq_len must be a number (vLLM takes the model's context "
     "length from it), got '4k'"),
    ("messages-without-a-chat-template", ["data.train={sandbox}/m.jsonl", "data.messages_key=messages",
                                          "reward.fn=exact_match"], _messages,
     "data.messages_key: needs the tokenizer's chat template to encode the messages, and the built-in model "
     "tiny_llama has none (model=tiny_llama_chat has one); use data.prompt_key"),
    ("episodes-without-a-chat-template", ["env.fn=guess_number", "data.train=guess_number"], None,
     "env.fn: needs the tokenizer's chat template to render the episodes' messages, and the built-in model "
     "tiny_llama has none (model=tiny_llama_chat has one)"),
    ("episodes", ["env=guess_number"], None, ""),
    ("resume", ["run.name=a", "+resume=step_5"], _ckpt("a", 5), ""),
    ("resume-other-lora", ["run.name=c", "+resume=step_5", "peft.alpha=64"], _ckpt("c", 5),
     "resume: {root}/c/checkpoints/step_5 was written for peft.alpha="),
    ("resume-damaged-record", ["run.name=d", "+resume=step_5"],
     _ckpt("d", 5, info={"step": 5, "consumed_prompts": -1}),
     "resume: {root}/d/checkpoints/step_5/training_info.json: consumed_prompts: must be an integer >= 0, got -1"),
    ("resume-other-schedule", ["run.name=s", "+resume=step_5", "grpo.max_num_steps=20"], _ckpt("s", 5),
     "grpo.max_num_steps: {root}/s/checkpoints/step_5 was trained with a learning-rate schedule of "
     "grpo.max_num_steps = 40, this run has 20: megatron's scheduler refuses to continue another schedule; resume "
     "with optim.lr_decay_iters=40, or with optim.override_opt_param_scheduler=true"),
    ("resume-other-schedule-overridden", ["run.name=o", "+resume=step_5", "grpo.max_num_steps=20",
                                          "optim.override_opt_param_scheduler=true"], _ckpt("o", 5), ""),
    ("resume-finished", ["run.name=f", "+resume=latest", "grpo.max_num_steps=5"], _ckpt("f", 5),
     "grpo.max_num_steps: {root}/f/checkpoints/step_5 is at step 5: the run has done its 5 steps; to train on, "
     "resume with grpo.max_num_steps=N above 5 and optim.lr_decay_iters=40"),
    ("resume-finished-as-the-hint-says", ["run.name=h", "+resume=latest", "grpo.max_num_steps=8",
                                          "optim.lr_decay_iters=40"], _ckpt("h", 5), ""),
    ("rollouts-consistent", ["run.name=p", "+resume=latest"], _pipelined("p", _rollouts()), ""),
    ("rollouts-fewer-samples", ["run.name=q", "+resume=latest"], _pipelined("q", _rollouts(rows=1)),
     "resume: {root}/q/checkpoints/step_5/rollouts.json: step 6 holds 1 samples, its sampling settings make 64"),
    ("rollouts-more-ahead-than-lag", ["run.name=m", "+resume=latest"], _pipelined("m", _rollouts(ahead=2)),
     "resume: {root}/m/checkpoints/step_5/rollouts.json: holds 2 steps generated ahead, more than its max_lag 1"),
    ("rollouts-other-sampling", ["run.name=t", "+resume=latest"],
     _pipelined("t", _rollouts(sampling={"grpo": {"temperature": 0.5}})),
     "resume: {root}/t/checkpoints/step_5/rollouts.json: sampling: grpo.num_prompts_per_step is not what the "
     "checkpoint's config.yaml says"),
    ("rollouts-longer-than-max-new-tokens", ["run.name=l", "+resume=latest"], _pipelined("l", _rollouts(tokens=9)),
     "resume: {root}/l/checkpoints/step_5/rollouts.json: step 6 holds a sample of 2 + 9 tokens, longer than"),
]


def _fill(text: str, sandbox: Path) -> str:
    return text.replace("{root}", str(sandbox / "runs")).replace("{sandbox}", str(sandbox))


def _job_says(sandbox: Path, argv: list[str], monkeypatch) -> str:
    """The job's start on the run directory this command describes: '' when it reached the Ray head."""
    from launcher import paths
    from launcher.cluster import bootstrap
    from launcher.config import compose as config_mod
    from launcher.config.schema import ConfigError, typed
    from launcher.job.run_dir import resolved

    raw = config_mod.compose([a for a in argv if a != "submit=false"])
    cfg = typed(raw)
    paths.absolute_config(cfg)
    run = paths.run_dir(cfg)
    config_mod.save(resolved(raw, run), run / paths.CONFIG)  # what the submission writes (or a hand edit)
    for k, v in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "77", "SLURM_NTASKS": "3", "SLURM_JOB_NUM_NODES": "3",
                 "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_RESTART_COUNT": "0", "SLURM_LOCALID": "0",
                 "SLURM_NODEID": "0", "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(bootstrap, "run_head", lambda *a, **k: STARTED)
    try:
        assert bootstrap.run_task(run) == STARTED
    except ConfigError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("name,overrides,setup,message", CASES, ids=[c[0] for c in CASES])
def test_the_launcher_and_the_job_agree(name, overrides, setup, message, sandbox, capsys, monkeypatch):
    if setup:
        setup(sandbox)
    argv = [*SLURM, "submit=false", f"run.root={sandbox / 'runs'}", *(_fill(a, sandbox) for a in overrides)]
    rc = cli.main(argv)
    err = capsys.readouterr().err
    launcher = err.splitlines()[-1][len("error: "):] if rc else ""
    assert rc == (2 if message else 0), err
    assert launcher.startswith(_fill(message, sandbox)) and "Traceback" not in err, err
    assert len(err.splitlines()) == (1 if rc else len(err.splitlines())), err
    job = _job_says(sandbox, argv, monkeypatch)
    # the same line: a field's range is met again on the config.yaml the job reads (`<file>: <key>: ...`)
    assert job == launcher or (launcher and job.endswith(": " + launcher)), (job, launcher)
