"""A 2-point sweep of tiny GRPO runs on the local Slurm cluster: one job per point, followed with
`python -m launcher.status`, and one of them ended by `python -m launcher.stop` after a checkpoint,
with no requeue."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.sweep import read as read_sweep
from tests.helpers.held_step import HELD_REWARD, HELD_STEP, release, wait_held, wait_until
from tests.helpers.preemption import job_ended
from tests.helpers.slurm_jobs import driver_out, task_log

pytestmark = pytest.mark.slurm
PY = sys.executable
LONG = 40  # the point that is stopped long before its last step


def status(*args: str) -> list[dict]:
    p = subprocess.run([PY, "-m", "launcher.status", *args, "--json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_sweep_submits_one_job_per_point_status_follows_them_stop_ends_one_without_requeue(slurm_cluster, tmp_path):
    p = subprocess.run([PY, "-m", "launcher", "-m", "topology=slurm_2n", f"grpo.max_num_steps=3,{LONG}",
                        "checkpointing.save_period=2", "checkpointing.keep_top_k=null", "logging.tensorboard=false",
                        f"run.root={tmp_path}", *HELD_REWARD], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    sweep_dir = Path(re.search(r"^sweep (\S+) \(2 point\(s\)", p.stdout, re.M).group(1))
    rows = read_sweep(sweep_dir)
    names = [r["run_name"] for r in rows]
    assert names == ["slurm_2n-tiny_llama-max_num_steps3", f"slurm_2n-tiny_llama-max_num_steps{LONG}"]
    jobs = [r["job_id"] for r in rows]
    assert all(j and j.isdigit() for j in jobs) and jobs[0] != jobs[1], rows
    for r, job in zip(rows, jobs):
        assert re.search(rf"^{r['point']}\s.*{r['run_name']}\s+{job}$", p.stdout, re.M), p.stdout
    runs = [Path(r["run_dir"]) for r in rows]
    assert f"follow it: python -m launcher.status {sweep_dir} --watch" in p.stdout
    release(runs[0])  # the short point runs through; the long one waits in step HELD_STEP (held_step)

    # follow both with one command until the long one has a checkpoint
    seen: list[set] = [set(), set()]
    deadline = time.time() + 480
    while True:
        infos = status(str(sweep_dir))
        assert [i["job_id"] for i in infos] == jobs
        for k, i in enumerate(infos):
            seen[k].add(i["state"])
            assert i["state"] in ("PENDING", "RUNNING", "COMPLETING", "COMPLETED"), (i, task_log(runs[k], jobs[k]))
            assert i["max_num_steps"] == (3, LONG)[k] and i["attempts"] == 1
        if infos[1]["checkpoint"] and infos[1]["step"] >= 2 and infos[1]["state"] == "RUNNING":
            break
        assert time.time() < deadline, (infos, task_log(runs[1], jobs[1])[-3000:])
        time.sleep(2)
    assert "RUNNING" in seen[1]
    running = infos[1]
    assert running["seconds_per_step"] > 0 and running["eta_s"] > 0 and running["reward"] is not None
    assert any(log.endswith(f"{jobs[1]}_0_log.out") for log in running["logs"])

    # stop the long one while it is held in step HELD_STEP: after that step and a checkpoint, no requeue
    ended = job_ended(slurm_cluster, jobs[1], driver_out(runs[1], jobs[1]))
    wait_held(runs[1], ended, timeout=120)
    t0 = time.time()
    stop = subprocess.Popen([PY, "-m", "launcher.stop", str(runs[1]), "--timeout", "300"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until("the job to take the stop request", lambda: "stop requested (" in task_log(runs[1], jobs[1]),
               ended, timeout=120)
    release(runs[1])
    out, err = stop.communicate(timeout=360)
    log1 = task_log(runs[1], jobs[1])
    assert stop.returncode == 0, out + err + log1[-3000:]
    assert f"asked job {jobs[1]} ({names[1]}, step " in out
    m = re.search(rf"job {jobs[1]} stopped at \S+ at step (\d+)/{LONG} \(newest checkpoint (\S+)\); state COMPLETED, "
                  r"not requeued", out)
    assert m, out
    k = int(m.group(1))
    assert k == HELD_STEP and m.group(2) == str(runs[1] / "checkpoints" / f"step_{k}")
    print(f"stop took {time.time() - t0:.0f}s")
    assert "stop requested (python -m launcher.stop" in log1 and "not requeued" in log1
    assert "requeueing" not in log1

    assert slurm_cluster.wait_job(jobs[0], timeout=480) == "COMPLETED", task_log(runs[0], jobs[0])[-3000:]
    assert slurm_cluster.wait_job(jobs[1], timeout=60) == "COMPLETED"
    sacct = slurm_cluster.run("sacct", "-n", "-X", "-P", "-D", "-j", jobs[1], "-o", "State").split()
    assert sacct == ["COMPLETED"]  # one instance: never requeued
    steps = [json.loads(line)["step"] for line in (runs[1] / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, k + 1))

    done = status(str(sweep_dir))
    assert [(i["state"], i["step"], i["max_num_steps"], i["requeues"]) for i in done] == [
        ("COMPLETED", 3, 3, 0), ("COMPLETED", k, LONG, 0)]
    assert done[0]["checkpoint"] == str(runs[0] / "checkpoints" / "step_3") and done[0]["stopped"] is None
    assert done[1]["stopped"]["step"] == k and done[1]["stop_requested"] is None and done[1]["eta_s"] is None
    text = subprocess.run([PY, "-m", "launcher.status", str(sweep_dir)], capture_output=True, text=True,
                          timeout=60).stdout
    assert re.search(rf"^{names[1]}\s+{jobs[1]}\s+COMPLETED, stopped on request\s+1\s+{k}/{LONG}\s", text, re.M), text
    assert re.search(rf"^{names[0]}\s+{jobs[0]}\s+COMPLETED\s+1\s+3/3\s", text, re.M), text
