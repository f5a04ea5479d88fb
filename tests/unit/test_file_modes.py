"""Every file the launcher and its commands leave behind has the run directory's modes (docs/security.md).

A submission (Slurm and local topology, submit=false), a sweep, a stop, a status and an export are
run through their public entry points, with a secret in `slurm.setup` and a typical login umask
(022); then every file and folder they left is walked: folders 0700 (0750 with
`run.shared_with_group=true`), files 0600 (0640), scripts 0700 (0750), and every entry's parent
folder the folder mode. The job's own writers (node reports, `done`, `head.json`, failures, the
stop record, a checkpoint with the trainer ranks' files) are called as the job calls them, with
the same walk. A new writer that bypasses launcher.files shows up here as a world-readable file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from launcher import __main__ as cli
from tests.helpers import run_lock

SLURM = ["topology=slurm_3n"]
SECRET = "slurm.setup=['export HF_TOKEN=hf_secret']"


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def walk(root: Path, shared: bool) -> list[Path]:
    """Every entry below `root` (and `root`): assert its mode and its parent's; return them."""
    dirs, plain, script = (0o750, 0o640, 0o750) if shared else (0o700, 0o600, 0o700)
    seen = []
    for p in [root, *sorted(root.rglob("*"))]:
        if p.is_symlink():
            continue
        want = dirs if p.is_dir() else script if p.name.endswith((".sbatch", ".sh")) else plain
        assert mode(p) == want, f"{p}: {oct(mode(p))}, want {oct(want)}"
        if p != root:
            assert mode(p.parent) == dirs, f"{p.parent}: {oct(mode(p.parent))}"
        seen.append(p)
    return seen


@pytest.fixture(params=[False, True], ids=["private", "shared"])
def shared(request) -> bool:
    return request.param


def flag(shared: bool) -> str:
    return f"run.shared_with_group={str(shared).lower()}"


def test_a_submission_leaves_only_private_files(sandbox, shared, capsys):
    reward = sandbox / "my_reward.py"
    reward.write_text("def score(response, example):\n    return 1.0\n")
    runs = sandbox / "runs"
    for extra in (SLURM, []):  # Slurm (config, plan, ray_job.sbatch) and local (the .in_use lock too)
        rc = cli.main([*extra, "submit=false", f"run.root={runs}", f"run.name=r{len(extra)}", flag(shared), SECRET,
                       f"reward.fn={reward}:score"])
        assert rc == 0, capsys.readouterr().err
    names = {p.relative_to(runs).as_posix() for p in walk(runs, shared)}
    assert {"r1/config.yaml", "r1/plan.txt", "r1/ray_job.sbatch", "r1/task_epilog.sh", "r1/reward/my_reward.py",
            "r1/logs",
            "r1/checkpoints", "r0/config.yaml", "r0/.in_use"} <= names
    assert "hf_secret" in (runs / "r1" / "config.yaml").read_text()


def test_a_sweep_record_is_as_private_as_its_runs(sandbox, shared, capsys):
    """issue 26: sweep.jsonl (every point's overrides, the secret included) was 0644 in a 0755 folder."""
    runs = sandbox / "runs"
    rc = cli.main(["-m", *SLURM, "submit=false", f"run.root={runs}", "peft.dim=8,16", flag(shared), SECRET])
    assert rc == 0, capsys.readouterr().err
    (record,) = runs.glob("sweeps/*/sweep.jsonl")
    assert "hf_secret" in record.read_text()
    walk(runs, shared)


def test_stop_and_status_write_only_private_files(sandbox, shared, capsys):
    from launcher import files, status, stop
    from launcher.cluster import stop as job_stop

    runs = sandbox / "runs"
    assert cli.main(["submit=false", f"run.root={runs}", "run.name=l", flag(shared)]) == 0
    run = runs / "l"
    files.make_dir(run / "ray" / f"local-{os.getpid()}.0")  # a local run whose process (this one) lives, as it makes it
    capsys.readouterr()
    with run_lock.held(run):  # and holds its run directory
        assert status.main([str(run)]) == 0
        before = sorted(p.name for p in run.rglob("*"))
        assert status.main([str(run), "--json"]) == 0 and sorted(p.name for p in run.rglob("*")) == before
        assert stop.main([str(run), "--no-wait"]) == 0, capsys.readouterr().err
    assert (run / "stop_requested").is_file()
    assert job_stop.finish_stop_request(run, f"local-{os.getpid()}", {"step": 3, "stopped": True})  # the job's side
    assert (run / "stopped.json").is_file()
    walk(runs, shared)


def test_the_jobs_own_writers(sandbox, shared, capsys):
    """head.json, registered, done, a node report, failures.jsonl, metrics, a checkpoint (the trainer
    ranks write with the umask: the commit brings them to the policy) and its branch move."""
    from launcher import files, paths
    from launcher.cluster import bootstrap, restarts, watch
    from launcher.cluster.context import JobContext
    from launcher.config.schema import Checkpointing, Logging
    from launcher.driver.checkpoints import CheckpointManager
    from launcher.driver.metrics import MetricsLogger
    from tests.helpers.checkpoints import config_yaml, trainer_state

    runs = sandbox / "runs"
    assert cli.main(["submit=false", f"run.root={runs}", "run.name=j", flag(shared)]) == 0
    run = runs / "j"
    ctx = JobContext(run, "4242", 0, 1, ["node1", "node2"])
    files.make_dir(ctx.rendezvous)
    files.write_json(ctx.rendezvous / paths.HEAD, {"ip": "127.0.0.1", "port": 6379, "host": "node1"})
    files.touch(ctx.rendezvous / paths.REGISTERED)
    watch.write_node_report(ctx, "this node's Ray stopped")
    restarts.record_failure(run, "4242", RuntimeError("node 1 left"))
    bootstrap.finished_before(JobContext(run, "4242", 1, 0, ["node1", "node2"]), 5)
    m = MetricsLogger(run, Logging(tensorboard=False), total_steps=4)
    for s in (1, 2, 3):
        m.log(s, {"train/reward": 0.5})
    m.close()
    manager = CheckpointManager(run / "checkpoints", Checkpointing(keep_top_k=None))
    for step in (2, 3):
        tmp = manager.begin(step)
        trainer_state(tmp / "trainer", step)   # written with the umask, as torch's writer does
        manager.commit(tmp, step, {"consumed_prompts": step, "metrics": {}}, config_yaml())
    assert mode(run / "checkpoints" / "step_2" / "trainer" / ".metadata") == (0o640 if shared else 0o600)
    manager.start_branch(manager.resolve("step_2"), run)  # step_3 and metrics row 3 moved aside
    names = {p.name for p in walk(runs, shared)}
    assert {"head.json", "registered", "done", "failed_node1.json", "failures.jsonl", "metrics.jsonl",
            "training_info.json", "manifest.json", "abandoned"} <= names


def test_an_export_is_written_with_the_checkpoint_runs_modes(sandbox, shared, tiny_model, capsys):
    import torch

    from launcher import export
    from tests.helpers.checkpoints import checkpoint, config_yaml

    base = tiny_model("tiny_llama")
    lora = {"decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight": torch.randn(2, 8, 128),
            "decoder.layers.self_attention.linear_qkv.adapter.linear_out.weight": torch.randn(2, 256, 8)}
    ckpt = checkpoint(sandbox / "runs" / "e" / "checkpoints", 1, tensors=lora,
                      config=config_yaml(f"model.path={base}", "peft=lora_attention", "peft.dim=8", "run.name=e",
                                         flag(shared)))
    out = sandbox / "adapters" / "mine"
    assert export.main(["--checkpoint", str(ckpt), "--out", str(out)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    walk(sandbox / "adapters", shared)


# ------------------------------------------------------------------------------ modes through links (round three)
def test_a_run_directory_that_is_a_link_gets_the_policy_on_the_folder_it_leads_to(sandbox, shared, capsys):
    """RUN is a symlink to a world-writable folder of yours: its modes are set on that folder (before,
    the link was skipped and the folder kept 0777: anyone could replace ray_job.sbatch), and the
    files holding secrets get the policy's mode, not the folder's group bits."""
    world = sandbox / "world"
    world.mkdir()
    world.chmod(0o777)
    (sandbox / "runs").mkdir()
    (sandbox / "runs" / "lnk").symlink_to(world)
    rc = cli.main([*SLURM, "submit=false", f"run.root={sandbox / 'runs'}", "run.name=lnk", flag(shared), SECRET])
    assert rc == 0, capsys.readouterr().err
    assert {"checkpoints", "config.yaml", "logs", "ray_job.sbatch"} <= {p.name for p in walk(world, shared)}


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder another user owns needs root")
def test_a_run_directory_another_user_owns_is_refused(sandbox, capsys):
    theirs = sandbox / "theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    os.chown(theirs, 65534, 65534)
    (sandbox / "runs").mkdir()
    (sandbox / "runs" / "x").symlink_to(theirs)
    assert cli.main([*SLURM, "submit=false", f"run.root={sandbox / 'runs'}", "run.name=x", SECRET]) == 2
    assert capsys.readouterr().err == (f"error: run.name: {sandbox / 'runs' / 'x'} (a link to {theirs}) belongs to "
                                       f"user id 65534, not to you: they could replace what the run writes there\n")
    assert list(theirs.iterdir()) == []


@pytest.mark.parametrize("folder_mode,shared", [(0o700, False), (0o750, True), (0o755, False), (0o777, False),
                                                (0o770, False), (0o2750, True)])
def test_a_folder_passes_on_the_shared_policy_only_when_it_has_that_policy(tmp_path, folder_mode, shared):
    """launcher.files writes into an existing folder with the policy of that folder: the shared one only
    from a folder that has exactly the shared policy's bits, never wider ones from a folder it did not make."""
    from launcher import files

    d = tmp_path / "d"
    d.mkdir()
    d.chmod(folder_mode)
    files.write(d / "secret.yaml", "token: x\n")
    assert mode(d / "secret.yaml") == (0o640 if shared else 0o600)
