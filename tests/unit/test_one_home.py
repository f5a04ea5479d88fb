"""Facts with one home each, and that nothing else writes them again:
- the metric keys of a step's row (launcher.metric_names): no other launcher module holds
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
from launcher import metric_names as names
from launcher.job import slurm_job

ROOT = Path(__file__).resolve().parents[2]
METRIC_KEY = re.compile(r"^(train|val|timing|refit|data|reward|response|dynamic_sampling|pipeline)/[a-z_]+$")


def metric_literals(source: str) -> list[str]:
    return [n.value for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and METRIC_KEY.match(n.value)]


def test_metric_keys_are_written_only_in_metric_names():
    found = {str(p.relative_to(ROOT)): keys for p in sorted((ROOT / "launcher").rglob("*.py"))
             if p.name != "metric_names.py" and (keys := metric_literals(p.read_text()))}
    assert found == {}
    assert metric_literals('row = {"train/reward": 1.0, "step": 3}') == ["train/reward"]  # the scan finds one
    assert metric_literals('m = {"pipeline/lag": 1, "response/truncated_fraction": 0.0}') == [
        "pipeline/lag", "response/truncated_fraction"]


def phases_set(sources: list[str]) -> list[ast.expr]:
    """What the code sets as the driver's phase: every `...["phase"] = value`; where the value is a
    parameter of the function around it (a setter: GrpoRun.phase(name), the pipeline's
    _doing(phase, ...)), the arguments its callers pass for that parameter instead."""
    values: list[ast.expr] = []
    setters: dict[str, int] = {}   # a setter's name -> the position of its phase parameter

    def visit(node: ast.AST, function: str, params: list[str]) -> None:
        if isinstance(node, ast.FunctionDef):
            function, params = node.name, [a.arg for a in node.args.args if a.arg != "self"]
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript)
                and isinstance(node.targets[0].slice, ast.Constant) and node.targets[0].slice.value == "phase"):
            if isinstance(node.value, ast.Name) and node.value.id in params:
                setters[function] = params.index(node.value.id)
            else:
                values.append(node.value)
        for child in ast.iter_child_nodes(node):
            visit(child, function, params)

    trees = [ast.parse(source) for source in sources]
    for tree in trees:
        visit(tree, "", [])
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
                if name in setters and len(n.args) > setters[name]:
                    values.append(n.args[setters[name]])
    return values


def test_the_phases_the_driver_sets_are_the_ones_progress_reads():
    """Every `self.phase(...)` / ctx.progress["phase"] = ... of the driver, directly or through a
    setter, names a progress constant (a string there would be a second list), and each has its text."""
    set_by_driver = phases_set([p.read_text() for p in (ROOT / "launcher" / "driver").rglob("*.py")])
    assert len(set_by_driver) >= 8
    for arg in set_by_driver:
        assert isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "progress", \
            ast.unparse(arg)
        assert getattr(progress, arg.attr) in progress.PHASES
    assert progress.phase_text({"phase": progress.START_UP}) == progress.PHASES[progress.START_UP]


def test_a_phase_passed_through_a_setter_is_seen():
    found = phases_set(["class P:\n"
                        "    def _doing(self, phase, step, fn):\n"
                        "        self.progress['phase'] = phase\n"
                        "    def run(self):\n"
                        "        self._doing('refit', 1, f)\n"
                        "        self.progress['phase'] = progress.GENERATION\n"])
    assert sorted(ast.unparse(v) for v in found) == ["'refit'", "progress.GENERATION"]


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
