"""The command line a Hydra user expects: --cfg job|all, -m sweeps (expansion, names, all-or-nothing
validation, sweep.jsonl), and the status/stop views of a run read from its run directory."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from launcher import paths, progress
from tests.helpers import run_lock
from launcher import status as status_mod
from launcher import stop as stop_cli
from launcher import sweep as sweep_mod
from launcher.__main__ import main
from launcher.config.schema import ConfigError
from launcher.cluster import stop as stop_mod

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "launcher", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd or REPO)


# ------------------------------------------------------------------------------------- --cfg
def test_cfg_job_prints_what_a_submit_false_run_saves_in_config_yaml(tmp_path):
    args = ["topology=slurm_3n", "peft.dim=8", "optim.lr=3e-2", f"run.root={tmp_path}"]
    shown = cli("--cfg", "job", *args)
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr
    assert not any(tmp_path.iterdir())  # printing writes nothing
    written = cli(*args, "submit=false")
    assert written.returncode == 0, written.stderr
    saved = (tmp_path / "slurm_3n-tiny_llama" / "config.yaml").read_text()
    # the same text, except submit (false in the written run, its default when printed)
    assert shown.stdout.replace("submit: true", "submit: false") == saved
    assert yaml.safe_load(shown.stdout)["peft"]["dim"] == 8


def test_cfg_all_adds_the_derived_run_dir_and_plan_and_imports_no_torch(tmp_path):
    code = ("import sys; from launcher.__main__ import main; "
            f"rc = main(['--cfg=all', 'topology=slurm_2n', 'run.root={tmp_path}']); "
            "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH', rc)")
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip().endswith("NO_TORCH 0")
    job, derived = list(yaml.safe_load_all(p.stdout.rsplit("\n", 2)[0]))
    assert job["topology"]["name"] == "slurm_2n" and "launcher" not in job
    assert derived["launcher"]["run_dir"] == str(tmp_path / "slurm_2n-tiny_llama")
    assert derived["launcher"]["executor"] == "slurm" and derived["launcher"]["nodes"] == 2
    assert "node 1" in derived["launcher"]["plan"]


@pytest.mark.parametrize("args, message", [
    (["--cfg", "hydra"], "error: --cfg: must be job or all, got 'hydra' (there is no hydra config to print)"),
    (["--cfg"], "error: --cfg: needs a value: job or all"),
    (["--max-points=0", "-m", "peft.dim=8"], "error: --max-points: must be a positive whole number, got '0'"),
    (["--verbosity"], "error: --verbosity: not an option; arguments are key=value overrides (see --help)"),
    (["--max"], "error: --max: not an option; arguments are key=value overrides (see --help)"),  # no abbreviations
    (["-q", "-v"], "error: -v: not allowed with argument -q/--quiet"),
    (["peft.dim=8,16"], "error: peft.dim=8,16: is a sweep: add -m (--multirun) for one run per value, or quote "
                        "a value that holds commas: key='a,b'"),
])
def test_bad_options_get_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == message


def test_help_lists_cfg_multirun_status_and_stop(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for text in ("--cfg job", "--cfg all", "-m, --multirun", "--max-points N", "python -m launcher.status",
                 "python -m launcher.stop RUN_DIR"):
        assert text in out


def test_help_for_a_section_or_key_shows_each_keys_doc_and_range_from_the_schema(capsys, monkeypatch):
    from types import MappingProxyType

    from launcher.config.fields import Range, leaves
    from launcher.config.schema import Config, Peft

    assert main(["--help", "grpo.loss", "peft.dim"]) == 0
    out = capsys.readouterr().out
    assert "peft.dim: int = 16    allowed: >= 1 (checked when peft.enabled=true)\n      LoRA rank\n" in out
    assert "grpo.loss.ratio_clip_c: float? = 10.0    allowed: > 1 or null;" in out
    loss = [leaf for leaf in leaves(Config) if leaf.key.startswith("grpo.loss.")]
    assert len(loss) == 8 and all(f"  {leaf.key}: " in out and f"\n      {leaf.doc}\n" in out + "\n" for leaf in loss)
    # read from the schema: another doc and range on the field is what the help says
    field = next(f for f in dataclasses.fields(Peft) if f.name == "dim")
    monkeypatch.setattr(field, "metadata", MappingProxyType({**field.metadata, "doc": "the planted doc",
                                                              "check": Range(2, 64)}))
    assert main(["--help", "peft.dim"]) == 0
    assert "peft.dim: int = 16    allowed: [2, 64] (checked when peft.enabled=true)\n      the planted doc" in \
        capsys.readouterr().out
    assert main(["--help", "grpo.nope"]) == 2
    assert capsys.readouterr().err.startswith("error: grpo.nope: no such key or section; sections: topology, ")


def test_help_lists_common_keys_with_their_docs(capsys):
    from launcher.config.fields import leaves
    from launcher.config.schema import Config

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    docs = {leaf.key: leaf.doc for leaf in leaves(Config)}
    assert f"  {'refit.mode':<24}merged | merged_delta | adapter\n{'':26}{docs['refit.mode']}\n" in out
    assert docs["slurm.time_min"] in out and docs["dry_run"] in out


# ------------------------------------------------------------------------------------- expansion
def test_expansion_is_the_cartesian_product_in_command_line_order():
    points = sweep_mod.expand(["topology=slurm_2n", "peft.dim=8,16", "optim.lr=choice(1e-4,3e-4)"])
    assert [p.overrides for p in points] == [
        ["topology=slurm_2n", "peft.dim=8", "optim.lr=0.0001"], ["topology=slurm_2n", "peft.dim=8", "optim.lr=0.0003"],
        ["topology=slurm_2n", "peft.dim=16", "optim.lr=0.0001"], ["topology=slurm_2n", "peft.dim=16", "optim.lr=0.0003"]]
    assert [p.swept for p in points][1] == [("peft.dim", "8"), ("optim.lr", "0.0003")]


def test_range_and_glob_over_a_config_group():
    assert [p.swept for p in sweep_mod.expand(["peft.dim=range(4,13,4)"])] == [
        [("peft.dim", "4")], [("peft.dim", "8")], [("peft.dim", "12")]]
    globbed = sweep_mod.expand(["topology=glob(slurm_*,exclude=slurm_4n)"])
    assert [p.overrides for p in globbed] == [["topology=slurm_2n"], ["topology=slurm_3n"]]


# Hydra's own expectations: facebookresearch/hydra, tests/test_basic_sweeper.py, test_split (the cases
# without batching: ids simple, split_1d, not_split_yaml_list, list_of_lists, no_batching, range),
# commit 11d0e9c13403ec155514c2ca3395aac6e467e08f.
HYDRA_TEST_SPLIT = [
    (["x=10"], [["x=10"]]),
    (["x=10,20"], [["x=10"], ["x=20"]]),
    (["x=[10,20]"], [["x=[10,20]"]]),
    (["x=[a,b,c],[d,e,f]"], [["x=[a,b,c]"], ["x=[d,e,f]"]]),
    (["a=1,2", "b=10,11"], [["a=1", "b=10"], ["a=1", "b=11"], ["a=2", "b=10"], ["a=2", "b=11"]]),
    (["a=range(0,3)"], [["a=0"], ["a=1"], ["a=2"]]),
]


@pytest.mark.parametrize("overrides, expected", HYDRA_TEST_SPLIT)
def test_hydras_own_basic_sweeper_cases(overrides, expected):
    assert [p.overrides for p in sweep_mod.expand(overrides)] == expected


# Lists to expand as Hydra's BasicSweeper.split_arguments does (installed hydra-core, compared live):
# a repeated key, sweep or not, keeps its first place and takes its last values; +key, ++key, ~key
# and group@package are keys of their own; values are written as Hydra writes them.
SAME_AS_HYDRA = [
    ["peft.dim=8,16", "peft.dim=32,64"],
    ["grpo.max_num_steps=1,2", "grpo.max_num_steps=3"],
    ["grpo.max_num_steps=3", "grpo.max_num_steps=1,2"],
    ["peft.dim=8,16", "optim.lr=1e-4", "peft.dim=32", "optim.lr=1e-3,1e-2"],
    ["a=1", "b=2,3", "a=4,5"],
    ["topology=slurm_2n,slurm_3n", "topology=local"],
    ["topology=slurm_2n", "peft.dim=8,16", "topology=slurm_3n,slurm_4n"],
    ["+x.y=1", "x.y=2,3"],
    ["++peft.dim=8,16", "peft.dim=4", "++peft.dim=32"],
    ["~slurm.qos", "slurm.qos=a,b", "~slurm.qos"],
    ["model@foo=tiny_llama,tiny_qwen2", "model=tiny_qwen3"],
    ["optim.lr=choice(1e-4,3e-4)", "peft.dim=range(4,13,4)", "optim.lr=0.1"],
    ["+slurm.extra_sbatch.comment='a b','c,d'", "data.system_prompt=x y", "peft.dim= 8"],
    ["grpo.loss.ratio_clip_c=null,10", "a=[1,2],[3]", "b={x:1}"],
]


@pytest.mark.parametrize("overrides", SAME_AS_HYDRA)
def test_expansion_is_hydras_basic_sweeper(overrides):
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (hydra,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
    assert [p.overrides for p in sweep_mod.expand(overrides)] == hydra


def test_the_last_override_of_a_key_wins():
    assert [p.overrides for p in sweep_mod.expand(["peft.dim=8,16", "peft.dim=32,64"])] == [
        ["peft.dim=32"], ["peft.dim=64"]]
    (point,) = sweep_mod.expand(["grpo.max_num_steps=1,2", "grpo.max_num_steps=3"])
    assert point.overrides == ["grpo.max_num_steps=3"] and point.swept == []
    points = sweep_mod.expand(["topology=slurm_2n,slurm_3n", "peft.dim=8", "topology=slurm_4n,local"])
    assert [p.swept for p in points] == [[("topology", "slurm_4n")], [("topology", "local")]]
    assert points[0].overrides == ["topology=slurm_4n", "peft.dim=8"]


@pytest.mark.parametrize("overrides, max_points, message", [
    (["peft.dim=interval(1,4)"], 64, "peft.dim=interval(1,4): interval() needs a sampling sweeper; list the values "
                                     "(a=1,2,3) or use range(start,stop,step)"),
    (["peft.dim=glob(*)"], 64, "peft.dim=glob(*): glob() sweeps the options of a config group (topology, "),
    (["topology=glob(nothing*)"], 64, "topology=glob(nothing*): this sweep has no values"),
    (["peft.dim=range(1,9)", "optim.lr=1,2,3"], 20, "-m: the sweep has 24 points (8 x 3); the limit is 20 "
                                                    "(raise it with --max-points=24)"),
    (["peft.dim=(8"], 64, "peft.dim=(8: cannot parse this override"),
])
def test_what_cannot_be_swept_is_one_clear_error(overrides, max_points, message):
    with pytest.raises(ConfigError) as e:
        sweep_mod.expand(overrides, max_points)
    assert str(e.value).startswith(message)


# ------------------------------------------------------------------------------------- names
def names(overrides: list[str], bases: list[str] | None = None) -> list[str]:
    points = sweep_mod.expand(overrides)
    sweep_mod.name_points(points, bases or ["slurm_2n-tiny_llama"] * len(points))
    return [p.name for p in points]


def test_run_names_carry_the_swept_values():
    assert names(["peft.dim=8,32", "optim.lr=1e-4,3e-4"]) == [
        "slurm_2n-tiny_llama-dim8-lr1e-4", "slurm_2n-tiny_llama-dim8-lr3e-4",
        "slurm_2n-tiny_llama-dim32-lr1e-4", "slurm_2n-tiny_llama-dim32-lr3e-4"]
    assert names(["refit=merged,adapter", "grpo.temperature=0.7,1.0"], ["local-tiny_llama"] * 4) == [
        "local-tiny_llama-merged-temperature0.7", "local-tiny_llama-merged-temperature1.0",
        "local-tiny_llama-adapter-temperature0.7", "local-tiny_llama-adapter-temperature1.0"]
    # a swept group already in the base name (run.name interpolates topology.name) is not repeated
    assert names(["topology=slurm_2n,slurm_3n"], ["slurm_2n-tiny_llama", "slurm_3n-tiny_llama"]) == [
        "slurm_2n-tiny_llama", "slurm_3n-tiny_llama"]
    # a swept run.name names the points itself
    assert names(["run.name=a,b", "peft.dim=8"], ["a", "b"]) == ["a", "b"]
    # two keys with the same last part keep their full path
    assert names(["peft.dim=8,16", "+x.dim=1,2"])[:2] == ["slurm_2n-tiny_llama-peft_dim8-x_dim1",
                                                         "slurm_2n-tiny_llama-peft_dim8-x_dim2"]


def test_names_never_hold_a_value_that_may_be_a_secret(sandbox, capsys):
    """Run names become `#SBATCH --job-name`, which `squeue` shows every user: a swept slurm.setup (shell
    lines with tokens), an assignment or a value naming a token is left out of the name (which of
    the key's values it is instead) and out of what the sweep prints; other values stay."""
    sweep = ["slurm.setup=['export HF_TOKEN=hf_abc123'],['export HF_TOKEN=hf_def456']",
             "+slurm.extra_sbatch.comment='WANDB_KEY=k1',plain"]
    assert names(sweep) == ["slurm_2n-tiny_llama-setup_v1-comment_v1", "slurm_2n-tiny_llama-setup_v1-comment_plain",
                            "slurm_2n-tiny_llama-setup_v2-comment_v1", "slurm_2n-tiny_llama-setup_v2-comment_plain"]
    rc = main(["-m", "topology=slurm_2n", "submit=false", f"run.root={sandbox / 'runs'}", *sweep])
    out = capsys.readouterr()
    assert rc == 0, out.err
    for secret in ("hf_abc123", "hf_def456", "k1"):
        assert secret not in out.out + out.err
        for script in (sandbox / "runs").glob("*/ray_job.sbatch"):
            job_name = next(x for x in script.read_text().splitlines() if x.startswith("#SBATCH --job-name="))
            assert secret not in job_name
    assert "<value 2 of the sweep>" in out.out


def test_run_names_are_one_safe_path_component_and_unique():
    got = names(["+slurm.extra_sbatch.comment='a/b','a b','a%b','../x'"])
    assert got == ["slurm_2n-tiny_llama-comment_a_b-p0", "slurm_2n-tiny_llama-comment_a_b-p1",
                   "slurm_2n-tiny_llama-comment_a_b-p2", "slurm_2n-tiny_llama-comment.._x"]
    long = names([f"+x.y='{'v' * 300}',w"])
    assert len(long[0]) == sweep_mod.NAME_MAX and long[1] == "slurm_2n-tiny_llama-y_w"
    for name in got + long:
        assert paths.run_name_error(name) is None, name


# ------------------------------------------------------------------------------------- sweeps
def test_one_bad_point_names_it_and_nothing_is_written(tmp_path):
    p = cli("-m", "topology=slurm_2n", "peft.dim=8,abc", "optim.lr=0.01,-1", f"run.root={tmp_path}", "submit=false")
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert sorted({ln.partition("): ")[0] for ln in lines[:-1]}) == [
        "error: point 1 (peft.dim=8 optim.lr=-1", "error: point 2 (peft.dim=abc optim.lr=0.01",
        "error: point 3 (peft.dim=abc optim.lr=-1"], lines
    # the validator's own line, prefixed with the point (its wording is test_config_validation's business)
    assert lines[0].startswith("error: point 1 (peft.dim=8 optim.lr=-1): optim.lr: ") and "-1" in lines[0], lines
    assert "error: point 2 (peft.dim=abc optim.lr=0.01): peft.dim: expected an integer, got 'abc'" in lines
    assert lines[-1] == "error: 3 of 4 sweep point(s) invalid; nothing was written or submitted"
    assert list(tmp_path.iterdir()) == []


def test_a_point_whose_run_holds_checkpoints_stops_the_sweep_before_any_submission(tmp_path):
    (tmp_path / "slurm_2n-tiny_llama-dim16" / "checkpoints" / "step_3").mkdir(parents=True)
    p = cli("-m", "topology=slurm_2n", "peft.dim=8,16", f"run.root={tmp_path}", "submit=false")
    assert p.returncode == 2
    assert p.stderr.startswith("error: point 1 (peft.dim=16): run.name: ") and p.stderr.count("\n") == 1
    assert "already holds checkpoints (step_3)" in p.stderr
    assert p.stderr.strip().endswith("; nothing was written or submitted")
    assert sorted(q.name for q in tmp_path.iterdir()) == ["slurm_2n-tiny_llama-dim16"]  # point 0 not written
    assert not (tmp_path / "sweeps").exists()


def test_submit_false_sweep_writes_every_run_and_the_sweep_record(tmp_path):
    p = cli("-m", "topology=slurm_2n", "peft.dim=8,16", "optim.lr=0.02", f"run.root={tmp_path}", "submit=false")
    assert p.returncode == 0, p.stderr
    (sweep_dir,) = (tmp_path / "sweeps").iterdir()
    assert sweep_dir.name.startswith("slurm_2n-tiny_llama-")
    rows = sweep_mod.read(sweep_dir)
    assert [(r["point"], r["run_name"], r["job_id"], r["state"]) for r in rows] == [
        (0, "slurm_2n-tiny_llama-dim8", None, "written"), (1, "slurm_2n-tiny_llama-dim16", None, "written")]
    for r, dim in zip(rows, (8, 16)):
        run = Path(r["run_dir"])
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert (saved["peft"]["dim"], saved["run"]["name"], saved["optim"]["lr"]) == (dim, run.name, 0.02)
        assert (run / "ray_job.sbatch").is_file() and not (run / "submissions.jsonl").exists()
    table = p.stdout.splitlines()
    assert table[0].split() == ["#", "peft.dim", "run", "job"]
    assert table[1].split() == ["0", "8", "slurm_2n-tiny_llama-dim8", "written"]
    assert f"sweep {sweep_dir} (2 point(s); record: sweep.jsonl)" in p.stdout
    # the status view reads the sweep: both runs, not submitted, at step 0
    infos = [status_mod.collect(d) for d in status_mod.runs_of([str(sweep_dir)])]
    assert [(i["run"], i["state"], i["step"], i["max_num_steps"]) for i in infos] == [
        ("slurm_2n-tiny_llama-dim8", "NOT SUBMITTED", 0, saved["grpo"]["max_num_steps"]),
        ("slurm_2n-tiny_llama-dim16", "NOT SUBMITTED", 0, saved["grpo"]["max_num_steps"])]


def test_dry_run_sweep_prints_every_point_and_writes_nothing(tmp_path):
    p = cli("-m", "topology=slurm_2n", "peft.dim=8,16", f"run.root={tmp_path}", "dry_run=true")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("== sbatch script submitit would submit") == 2
    assert "######## point 1/2: peft.dim=16 -> run slurm_2n-tiny_llama-dim16" in p.stdout
    assert "== sweep of 2 point(s) (dry run: nothing written or submitted)" in p.stdout
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------- progress
def test_step_line_and_eta():
    row = {"train/reward": 0.4125, "train/loss": 0.0123, "train/gen_kl_error": 1.2e-5, "timing/total_step": 3.0,
           "timing/transfer_and_update_weights": 0.125, "val/reward": 0.5}
    assert progress.step_line(3, 10, row) == (
        "[#######.................] step 3/10  reward 0.412  loss +0.0123  gen_kl_error 1.20e-05  "
        "val_reward 0.500  3.0 s/step  refit 0.12s  ETA 21s")
    assert progress.step_line(10, 10, {"train/reward": 1.0}) == "[########################] step 10/10  reward 1.000"
    assert progress.step_line(3, 10, row, running=False).endswith("3.0 s/step  refit 0.12s")  # ended: no ETA
    assert [progress.duration(s) for s in (None, 5, 65, 7300)] == ["-", "5s", "1m05s", "2h01m"]
    assert progress.seconds_per_step([{"timing/total_step": t} for t in (9, 1, 2, 3, 4, 5)]) == 3.0


def test_heartbeat_says_what_a_long_wait_waits_for():
    said = []
    with progress.waiting("waiting for 3 node(s)", said.append, every=0.2):
        time.sleep(0.75)
    assert len(said) >= 2 and said[0].startswith("still waiting for 3 node(s) (") and said[0].endswith("s)")
    beat = progress.Heartbeat(said.append, every=0.0)
    said.clear()
    beat.tick("training (step 2)")
    beat.tick("training (step 2)")
    beat.tick("generating (step 3)")  # a new phase starts its own clock: nothing said
    assert said == ["still training (step 2) (0s)"]
    assert progress.phase_text({}) == "starting: loading the model, starting trainer and vLLM actors"
    assert progress.phase_text({"phase": "checkpoint", "step": 4}) == "writing a checkpoint (step 4)"
    # what the driver sets reads as such: its start-up (was "start-up" verbatim) and validation
    assert progress.phase_text({"phase": "start-up"}) == progress.phase_text({})
    assert progress.phase_text({"phase": "validation", "step": 4}) == "validating (step 4)"


# ------------------------------------------------------------------------------------- status, stop
def local_run(tmp_path: Path, steps: int) -> Path:
    """A local run directory as a local run writes it: config.yaml, metrics rows (MetricsLogger),
    a complete checkpoint (CheckpointManager), the rendezvous of the process that ran it."""
    from launcher.config.schema import Checkpointing, Logging
    from launcher.driver.checkpoints import CheckpointManager
    from launcher.driver.metrics import MetricsLogger

    run = tmp_path / "local-tiny_llama"
    shown = cli("--cfg", "job", f"run.root={tmp_path}", "grpo.max_num_steps=6")  # what config.yaml holds
    assert shown.returncode == 0, shown.stderr
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(shown.stdout)
    m = MetricsLogger(run, Logging(tensorboard=False), total_steps=6)
    for s in range(1, steps + 1):
        m.log(s, {"train/reward": 0.1 * s, "timing/total_step": 2.0, "val/reward": 0.05 * s})
    from tests.helpers.checkpoints import trainer_state

    mgr = CheckpointManager(run / "checkpoints", Checkpointing())
    tmp = mgr.begin(2)
    trainer_state(tmp / "trainer", 2)
    mgr.commit(tmp, 2, {"consumed_prompts": 8, "metrics": {}}, shown.stdout)
    (run / "ray" / f"local-{os.getpid()}.0").mkdir(parents=True)
    return run


def test_status_of_a_local_run_from_its_run_directory(tmp_path, capsys):
    run = local_run(tmp_path, steps=3)
    capsys.readouterr()
    with run_lock.held(run):
        info = status_mod.collect(run)
    assert (info["state"], info["job_id"], info["step"], info["max_num_steps"]) == (
        "RUNNING", f"local-{os.getpid()}", 3, 6)  # this process holds the run's lock and has not written `done`
    assert (info["reward"], info["val_reward"], info["seconds_per_step"], info["eta_s"]) == (
        pytest.approx(0.3), pytest.approx(0.15), 2.0, 6.0)
    assert info["checkpoint"] == str(run / "checkpoints" / "step_2")
    (run / "ray" / f"local-{os.getpid()}.0" / "done").write_text(json.dumps({"ok": False, "error": "x"}))
    with open(run / "failures.jsonl", "a") as f:
        f.write(json.dumps({"time": "T", "job": f"local-{os.getpid()}", "error": "node 1 left\nmore"}) + "\n")
    assert status_mod.main([str(run), "--json"]) == 0
    (shown,) = json.loads(capsys.readouterr().out)
    assert (shown["state"], shown["failures"], shown["last_failure"]) == (
        "FAILED", 1, f"T job local-{os.getpid()}: node 1 left")
    assert status_mod.main([str(run), "--watch", "0.1"]) == 0  # ends by itself: the run has ended
    assert "FAILED" in capsys.readouterr().out
    assert status_mod.runs_of([f"run.root={tmp_path}"]) == [run]  # only a root: every run under it
    assert status_mod.main([str(tmp_path)]) == 0  # a folder of runs
    text = capsys.readouterr().out
    assert "local-tiny_llama" in text and "3/6" in text and "step_2" in text
    assert "[############............] step 3/6  reward 0.300" in text


def test_stop_request_stops_the_driver_like_a_preemption_and_is_recorded(tmp_path):
    seen = threading.Event()

    def driver(stop_event):
        seen.set()
        stop_event.wait(10)

    with stop_mod.running(driver, {}) as current:
        seen.wait(5)
        assert stop_mod.poll_stop_request(tmp_path) is False  # nothing asked
        stop_mod.write_stop_request(tmp_path, by="test")
        assert stop_mod.poll_stop_request(tmp_path) is True
        current.thread.join(5)
        assert current.stop.is_set() and not current.thread.is_alive()
    assert stop_mod.finish_stop_request(tmp_path, "42", {"step": 3, "stopped": True}) is True
    rec = stop_mod.read_stopped(tmp_path)
    assert (rec["job"], rec["step"], rec["stopped"], rec["requested"]["by"]) == ("42", 3, True, "test")
    assert stop_mod.stop_requested(tmp_path) is None  # consumed: a later job of the run is not stopped
    assert stop_mod.finish_stop_request(tmp_path, "43", {"step": 5}) is False


def test_stop_of_a_run_that_is_not_running(tmp_path, capsys):
    run = local_run(tmp_path, steps=1)
    (run / "ray" / f"local-{os.getpid()}.0" / "done").write_text(json.dumps({"ok": True}))
    capsys.readouterr()
    assert stop_cli.main([str(run)]) == 1
    assert capsys.readouterr().err.strip() == (f"error: {run}: not running (job local-{os.getpid()} COMPLETED); "
                                               f"nothing to stop")
    assert stop_cli.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'nope'}: not a run directory (no config.yaml) "
                                               f"nor a sweep directory (no sweep.jsonl)")


def test_status_finds_a_run_by_its_overrides_and_says_what_is_missing(tmp_path, capsys):
    assert status_mod.runs_of(["run.name=mine", f"run.root={tmp_path}"]) == [tmp_path / "mine"]
    assert status_mod.runs_of(["topology=slurm_3n", f"run.root={tmp_path}"]) == [tmp_path / "slurm_3n-tiny_llama"]
    assert status_mod.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'nope'}: does not exist (give a run directory, "
                                               f"a sweep directory or run.name=NAME)")
    assert status_mod.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path}: no run directory here (no config.yaml, "
                                               f"sweep.jsonl or runs below)")
    assert status_mod.main(["--watch", "x"]) == 2


def test_cfg_job_with_multirun_prints_each_point_as_its_run_would_save_it(tmp_path):
    p = cli("--cfg", "job", "-m", "topology=slurm_2n", "peft.dim=8,16", f"run.root={tmp_path}")
    assert p.returncode == 0, p.stderr
    docs = p.stdout.split("# point ")[1:]
    assert [d.splitlines()[0] for d in docs] == [
        f"0: peft.dim=8 -> {tmp_path}/slurm_2n-tiny_llama-dim8", f"1: peft.dim=16 -> {tmp_path}/slurm_2n-tiny_llama-dim16"]
    saved = [yaml.safe_load(d.split("\n", 1)[1]) for d in docs]
    assert [(c["peft"]["dim"], c["run"]["name"]) for c in saved] == [
        (8, "slurm_2n-tiny_llama-dim8"), (16, "slurm_2n-tiny_llama-dim16")]
    assert list(tmp_path.iterdir()) == []
