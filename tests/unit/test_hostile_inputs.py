"""Hostile and mistaken inputs, one line per case (docs/security.md).

Each case: the command-line overrides, the files set up first (a `setup` function of the
sandbox), the expected exit code and the start of the one stderr line. After a refusal (exit 2)
nothing under the sandbox and nothing in the project's conf/ may have changed; a case can name
more paths that must be unchanged. Nothing is submitted or run: `_run_here` and `_submit` are
replaced by a sentinel so a case that wrongly passes validation fails loudly instead of starting a
job. Adding a case is one line in CASES.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from launcher import __main__ as cli

REPO = Path(__file__).resolve().parents[2]
ROOT = "{root}"   # replaced by the sandbox's run.root


@dataclass
class Case:
    name: str
    argv: list[str]
    rc: int
    message: str                                   # the start of stderr's only line, after "error: "
    setup: Callable[[Path], None] | None = None    # files the case needs, under the sandbox
    unchanged: tuple[str, ...] = ()                # more paths (repo-relative) that must not change


def _ckpt(run: str, step: int, info: dict | None = None):
    """A complete-looking checkpoint RUN/checkpoints/step_N written with the real manager."""
    def setup(sandbox: Path) -> None:
        from launcher.config.schema import Checkpointing
        from launcher.driver.checkpoints import CheckpointManager

        manager = CheckpointManager(sandbox / "runs" / run / "checkpoints", Checkpointing())
        tmp = manager.begin(step)
        (tmp / "trainer").mkdir()
        (tmp / "trainer" / "x.bin").write_bytes(b"\0")
        manager.commit(tmp, step, {"consumed_prompts": 0, "metrics": {}}, "model: {}\n")
        if info is not None:
            p = manager.root / f"step_{step}" / "training_info.json"
            p.write_text(json.dumps(info))
    return setup


SLURM = ["topology=slurm_3n"]
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
]


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cli, "_run_here", lambda *a, **k: 99)
    monkeypatch.setattr(cli, "_submit", lambda *a, **k: 98)
    return tmp_path


def snapshot(*roots: Path) -> dict[str, str]:
    out = {}
    for root in roots:
        items = [root] if root.is_file() else sorted(root.rglob("*")) if root.exists() else []
        for p in items:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def argv_of(case: Case, sandbox: Path) -> list[str]:
    argv = [a.replace(ROOT, str(sandbox / "runs")) for a in case.argv]
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
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: " + case.message), err
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
