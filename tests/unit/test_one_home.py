"""Facts with one home each, and that nothing else writes them again:
- the metric keys of a step's row (launcher.driver.metric_names): no other launcher module holds
  one as a string;
- the driver's phases (launcher.progress): every phase the driver sets is one progress can say;
- Slurm job states (launcher.job.slurm_job): what they mean agrees with submitit's own reading of
  them, and task 0's logs are where submitit's SlurmJob says;
- the run-name rule and `+resume=latest` (launcher.paths).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from launcher import paths, progress
from launcher.driver import metric_names as names
from launcher.job import slurm_job

ROOT = Path(__file__).resolve().parents[2]
METRIC_KEY = re.compile(r"^(train|val|timing|refit|data|reward)/[a-z_]+$")


def metric_literals(source: str) -> list[str]:
    return [n.value for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and METRIC_KEY.match(n.value)]


def test_metric_keys_are_written_only_in_metric_names():
    found = {str(p.relative_to(ROOT)): keys for p in sorted((ROOT / "launcher").rglob("*.py"))
             if p.name != "metric_names.py" and (keys := metric_literals(p.read_text()))}
    assert found == {}
    assert metric_literals('row = {"train/reward": 1.0, "step": 3}') == ["train/reward"]  # the scan finds one


def test_the_phases_the_driver_sets_are_the_ones_progress_reads():
    """Every `self.phase(...)` / ctx.progress["phase"] = ... of the driver names a progress
    constant (a string there would be a second list), and each has its text."""
    set_by_driver = []
    for path in (ROOT / "launcher" / "driver").rglob("*.py"):
        tree = ast.parse(path.read_text())
        setter = {id(x) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "phase"
                  for x in ast.walk(f)}  # GrpoRun.phase(name) itself
        for n in ast.walk(tree):
            if id(n) in setter:
                continue
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "phase":
                set_by_driver += n.args
            if (isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Subscript)
                    and isinstance(n.targets[0].slice, ast.Constant) and n.targets[0].slice.value == "phase"):
                set_by_driver.append(n.value)
    assert len(set_by_driver) >= 8
    for arg in set_by_driver:
        assert isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "progress", \
            ast.unparse(arg)
        assert getattr(progress, arg.attr) in progress.PHASES
    assert progress.phase_text({"phase": progress.START_UP}) == progress.PHASES[progress.START_UP]


def test_slurm_states_mean_what_submitit_reads_them_as():
    """submitit's watcher (its own list of incomplete states) calls a job done exactly when we
    say it will never run again, or its instance was preempted (OVER)."""
    from submitit.slurm.slurm import SlurmInfoWatcher

    watcher = SlurmInfoWatcher()
    every = slurm_job.OVER | slurm_job.ACTIVE | {"PENDING", "READY", "UNKNOWN"}
    done = set()
    for i, state in enumerate(sorted(every)):
        job = str(1000 + i)
        watcher.register_job(job)
        watcher._info_dict[job] = {"State": state}
        if watcher.is_done(job, mode="cache"):
            done.add(state)
    assert slurm_job.FINISHED <= done
    assert not (done - slurm_job.OVER) - {"CONFIGURING", "SUSPENDED", "RESIZING", "STOPPED", "SUBMITTED"}
    assert "PREEMPTED" not in done  # submitit waits for its requeue; for the run dir it is not finished either
    assert not slurm_job.ACTIVE & slurm_job.OVER and slurm_job.FAILED <= slurm_job.FINISHED


def test_task_logs_are_where_submitit_puts_them(tmp_path):
    from submitit.slurm.slurm import SlurmJob

    job = SlurmJob(folder=slurm_job.submitit_folder(tmp_path), job_id="4242")
    assert slurm_job.task_logs(tmp_path, "4242") == (job.paths.stdout, job.paths.stderr)
    assert job.paths.stdout == tmp_path / "submitit" / "4242" / "4242_0_log.out"


def test_derived_names_follow_the_run_name_rule():
    for text in ("slurm_2n-tiny_llama-dim8", "a b/c", "..x..", "+lr=1e+3", "é" * 10, "x" * 300, ""):
        name = paths.safe_name(text)
        assert paths.run_name_error(name) is None, (text, name)
    assert paths.safe_name("slurm_2n-tiny_llama-dim8") == "slurm_2n-tiny_llama-dim8"
    assert len(paths.safe_name("x" * 300)) == paths.NAME_MAX


def test_latest_is_the_newest_step_by_number(tmp_path):
    for step in (2, 9, 10):
        (tmp_path / f"step_{step}").mkdir()
    (tmp_path / "step_x").mkdir()
    assert paths.resume_path("latest", tmp_path) == tmp_path / "step_10"   # not step_9 (by name)
    assert paths.resume_path("step_9", tmp_path) == tmp_path / "step_9"
    assert paths.resume_path("latest", tmp_path / "none") is None
    assert paths.resume_path(str(tmp_path / "step_2"), Path("/elsewhere")) == tmp_path / "step_2"


def test_rankable_metrics_are_logged_ones():
    assert names.REWARD in names.RANKABLE and all(k.startswith((names.TRAIN, names.VAL)) for k in names.RANKABLE)
