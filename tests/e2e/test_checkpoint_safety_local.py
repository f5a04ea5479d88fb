"""Real local runs (`python -m launcher` on this machine) for docs/security.md, on the session's
trained run (tests/e2e/conftest.py: 4 steps, checkpoints step_1..step_4) or a copy of it:
- a branch resume (+resume=step_2 on a run that has step_4) moves the newer checkpoints and
  metrics rows aside, keeps the branch's own checkpoint through retention, and its retry/requeue
  path resumes from the branch's newest; with another grpo.max_num_steps (and
  optim.override_opt_param_scheduler) the branch's step equals the uninterrupted run's, bitwise;
- a real trainer checkpoint whose `.metadata` was replaced by a pickle that runs code, with a
  manifest rewritten to match, is refused at submission: nothing runs;
- a real checkpoint whose records disagree with each other (training_info.json against its
  folder's N and against the trainers' own saved step; a negative step), manifest rewritten to
  match, is refused in one line naming the file and key, before Ray (no run directory is made)."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import deterministic, launch, rows, trainer_tensors

pytestmark = pytest.mark.e2e
PY = sys.executable
COMMON = ["grpo.max_num_steps=4", "checkpointing.save_period=2", "checkpointing.keep_top_k=null",
          "logging.tensorboard=false"]


def steps(run: Path) -> list[int]:
    return [x["step"] for x in rows(run)]


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_forged_real_checkpoint_is_refused_before_anything_runs(trained_run, tmp_path):
    from launcher.driver.checkpoints import MANIFEST, _files

    ckpt = tmp_path / "theirs" / "step_4"
    shutil.copytree(trained_run.checkpoint(4), ckpt)
    meta = ckpt / "trainer" / ".metadata"
    marker = tmp_path / "pwned"
    with open(meta, "rb") as f:
        real = pickle.load(f)
    meta.write_bytes(pickle.dumps((Payload(marker), real)))
    (ckpt / MANIFEST).write_text(json.dumps({"files": _files(ckpt)}))
    p = launch(tmp_path / "mine", *COMMON, f"+resume={ckpt}", rc=2)
    assert p.stderr.startswith(f"error: resume: {meta}: refused to unpickle posix.system") and \
        p.stderr.count("\n") == 1, p.stderr
    assert not marker.exists() and not (tmp_path / "mine").exists()
    e = subprocess.run([PY, "-m", "launcher.export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert e.returncode == 2 and "refused to unpickle posix.system" in e.stderr, e.stderr
    assert not marker.exists()


@pytest.mark.parametrize("folder,info,message", [
    ("step_4", {"step": 2, "consumed_prompts": 8}, "step: 2, but the folder is step_4"),
    ("step_2", {"step": 2, "consumed_prompts": 8}, "step: 2, but the trainer state in {ckpt}/trainer is at step 4"),
    ("step_4", {"step": -5, "consumed_prompts": -1}, "step: must be an integer >= 0, got -5"),
])
def test_a_real_checkpoint_whose_records_disagree_is_refused_before_ray(trained_run, tmp_path, folder, info,
                                                                       message):
    """issue 26: `"step": -5, "consumed_prompts": -1` (manifest rewritten) resumed "at step -5" and ran
    steps -4..3; the trainer's own saved step was never compared."""
    from tests.helpers.checkpoints import rewrite_manifest

    ckpt = tmp_path / "theirs" / folder
    shutil.copytree(trained_run.checkpoint(4), ckpt)
    (ckpt / "training_info.json").write_text(json.dumps({**info, "metrics": {}}))
    rewrite_manifest(ckpt)
    p = launch(tmp_path / "mine", *COMMON, f"+resume={ckpt}", rc=2)
    line = f"error: resume: {ckpt}/training_info.json: " + message.format(ckpt=ckpt)
    assert p.stderr.startswith(line) and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "mine").exists()   # no run directory, so no rendezvous: Ray never started
    assert p.stdout == ""


def test_resume_from_an_older_step_is_a_new_branch(trained_run, tmp_path):
    from launcher.cluster.restarts import resume_after_requeue
    from launcher.config.compose import compose
    from launcher.config.schema import typed

    run = trained_run.copy(tmp_path)
    before = steps(run)
    assert before == [1, 2, 3, 4]
    p = launch(tmp_path, "+resume=step_2", "grpo.max_num_steps=3", "checkpointing.save_period=1",
               "checkpointing.keep_top_k=1", "optim.override_opt_param_scheduler=true", "logging.tensorboard=false")
    assert "starts a new branch" in p.stderr
    (branch,) = (run / "checkpoints" / "abandoned").iterdir()
    assert branch.name.endswith("-from-step_2") and sorted(c.name for c in branch.iterdir()) == ["step_3", "step_4"]
    moved = (run / "abandoned" / branch.name / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in moved] == [3, 4]     # the old history, kept aside
    assert steps(run) == [1, 2, 3]                                # one history: the branch's
    kept = sorted(c.name for c in (run / "checkpoints").iterdir())
    assert "step_3" in kept and "step_4" not in kept              # the branch's checkpoint survives retention
    # its schedule was built for 3 steps (override_opt_param_scheduler), the saved one for 4: with the
    # demo's constant learning rate, step 3 is the uninterrupted run's, bitwise
    assert [deterministic(x) for x in rows(run)] == [deterministic(x) for x in trained_run.rows()[:3]]
    a, b = trainer_tensors(trained_run.checkpoint(3)), trainer_tensors(run / "checkpoints" / "step_3")
    assert sorted(a) == sorted(b) and any(".adapter." in k for k in a) and any("exp_avg" in k for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].equal(b[k]), k
    # a requeue or retry of this run continues the branch, not the abandoned step_4
    cfg = typed(compose([f"run.root={tmp_path}", *COMMON, "+resume=step_2"]))
    assert resume_after_requeue(cfg, run) == str(run / "checkpoints" / "step_3")
