"""The launcher's local executor end to end: a real Ray head with token auth, placement, cleanup,
and a head whose first start dies (its raylet's 15 s wait for a late dashboard agent) started again.

One run (`run.job=hold`: the placement smoke, then the cluster held until `touch RUN/release`)
for all of it: the actors on their planned nodes, a client with no token or a wrong one refused
and the job's token let in, a second launch on the running run's directory refused, and once
released: the job's `done` record, no Ray process of the job left, its Ray temp dir gone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.runs import left_in_tmp

pytestmark = pytest.mark.integration
PY = sys.executable
SLOW_AGENT = Path(__file__).resolve().parents[1] / "helpers" / "slow_agent"


def test_local_placement_token_auth_and_cleanup(tmp_path, no_ray_left):
    # the head's first `ray start` dies as on a busy node (its dashboard agent 25 s late: the raylet
    # aborts after 15 s); the launcher stops it and starts it again (ray.join_retries)
    slow = {"PYTHONPATH": os.pathsep.join(filter(None, [str(SLOW_AGENT), os.environ.get("PYTHONPATH")])),
            "SLOW_AGENT_ONCE": str(tmp_path / "agent_was_slow")}
    proc = subprocess.Popen([PY, "-m", "launcher", "run.job=hold", f"run.root={tmp_path}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **slow})
    run = tmp_path / "local-tiny_llama"
    try:
        deadline = time.time() + 400  # hang detection: a failed head start is noticed within Ray's 60 s
        while not list(run.glob("ray/*/head.json")) or not (run / "placement.json").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline
            time.sleep(0.5)
        report = json.loads((run / "placement.json").read_text())
        assert [(a["role"], a["index"]) for a in report["actors"]] == [("train", 0), ("train", 1), ("generation", 0)]
        assert (run / "config.yaml").is_file() and (run / "plan.txt").read_text().startswith("training: 2 ranks")
        rendezvous = next((run / "ray").iterdir())
        assert oct((rendezvous / "token").stat().st_mode & 0o777) == "0o600"
        head = json.loads((rendezvous / "head.json").read_text())
        attach = ("import ray, sys\n"
                  f"ray.init(address='{head['ip']}:{head['port']}', logging_level='ERROR')\n"
                  "print('NODES', len(ray.nodes()))\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        env["RAY_gcs_server_port_wait_time_s"] = "2"  # a refused client gives up after 2 tries, not 20
        denied = subprocess.run([PY, "-c", attach], capture_output=True, text=True, timeout=120,
                                env={**env, "RAY_AUTH_MODE": "disabled"})
        assert denied.returncode != 0
        assert "Authentication" in denied.stderr or "InvalidAuthToken" in denied.stderr
        wrong = tmp_path / "wrong_token"
        wrong.write_text("0" * 64)
        wrong.chmod(0o600)
        denied2 = subprocess.run([PY, "-c", attach], capture_output=True, text=True, timeout=120,
                                 env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)})
        assert denied2.returncode != 0
        allowed = subprocess.run([PY, "-c", attach], capture_output=True, text=True, timeout=120,
                                 env={**env, "RAY_AUTH_MODE": "token",
                                      "RAY_AUTH_TOKEN_PATH": str(rendezvous / "token")})
        assert "NODES 1" in allowed.stdout, allowed.stderr[-2000:]
        # a second launch on the directory of this running local job is refused before writing anything
        second = subprocess.run([PY, "-m", "launcher", f"run.root={tmp_path}"], capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"is in use by a run on this machine (pid {proc.pid} on " in second.stderr, second.stderr
    finally:
        (run / "release").touch()
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert (tmp_path / "agent_was_slow").is_file()
    failed = re.search(r"attempt 1/3 to start the Ray head failed: the Ray head at \S+ is down: raylet died: "
                       r"Timed out waiting for file \S+_port_\w+ \(log: (\S+/raylet\.\w+)\); starting it again", out)
    assert failed and Path(failed.group(1)).is_file(), out[-3000:]  # the dead raylet's log is kept in the run
    assert "attempt 2/3" not in out
    assert "placement smoke: 3 actors on their planned nodes" in out
    assert json.loads((rendezvous / "done").read_text()) == {"ok": True, "error": None}
    job = rendezvous.name.split(".")[0]
    no_ray_left(job, wait_s=0)  # every Ray process of the job was stopped ...
    assert left_in_tmp(job) == []  # ... and its Ray temp dir removed
