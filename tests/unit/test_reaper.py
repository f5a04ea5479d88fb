"""launcher.cluster.reaper: what a node's `ray start` leaves behind dies with it, orphans included.

A real process tree (sh, a backgrounded sleep re-parented to the reaper when its shell ends), no
Ray: when CMD ends, the reaper kills everything below it; when the bootstrap that started it is
killed, the same. Each sleep carries a marker the test looks for in the process table (a second
duration: GNU sleep adds them up).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import random

import psutil

from launcher.cluster import reaper


def _marked(marker: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])
            and "sleep" in (p.info["cmdline"] or [""])[0]]


def _marker() -> str:
    return f"0.{random.randrange(10**8, 10**9)}"


def _reaper_cmd(parent_pid: int, marker: str, then: str) -> list[str]:
    # the subshell's sleep outlives the subshell: re-parented to the reaper (a subreaper), not to init
    return [sys.executable, "-m", "launcher.cluster.reaper", str(parent_pid), "sh", "-c", f"(sleep 300 {marker} &); {then}"]


def _wait(what, timeout: float = 20.0):
    end = time.time() + timeout
    while time.time() < end:
        if (got := what()):
            return got
        time.sleep(0.1)
    return what()


def test_an_orphan_of_cmd_dies_when_cmd_ends():
    marker = _marker()
    proc = subprocess.Popen(_reaper_cmd(psutil.Process().pid, marker, "sleep 1"))
    orphan = _wait(lambda: _marked(marker))
    assert orphan and orphan[0].ppid() == proc.pid          # re-parented to the reaper
    assert proc.pid in [p for p in reaper.descendants(proc.pid)] and orphan[0].pid in reaper.descendants(proc.pid)
    assert proc.wait(timeout=30) == 0                         # CMD's own exit code
    assert _wait(lambda: not _marked(marker)), _marked(marker)


def test_the_tree_dies_when_the_bootstrap_is_killed():
    """The bootstrap (here a python that starts the reaper, as ray_node.start_ray does) killed by
    SIGKILL: its reaper notices and kills the tree."""
    marker = _marker()
    start = f"import os, subprocess, time; subprocess.Popen({_reaper_cmd(0, marker, 'sleep 300')!r}[:3] + " \
            f"[str(os.getpid())] + {_reaper_cmd(0, marker, 'sleep 300')!r}[4:]); time.sleep(300)"
    bootstrap = subprocess.Popen([sys.executable, "-c", start])
    assert _wait(lambda: _marked(marker))
    reaper_proc = psutil.Process(bootstrap.pid).children()[0]
    bootstrap.kill()
    bootstrap.wait()
    assert _wait(lambda: not _marked(marker)), _marked(marker)
    assert _wait(lambda: not reaper_proc.is_running() or reaper_proc.status() == psutil.STATUS_ZOMBIE)


def test_descendants_of_a_gone_pid_is_itself():
    p = subprocess.Popen(["true"])
    p.wait()
    assert reaper.descendants(p.pid) == [p.pid]


def _ray_temp_dir(root) -> tuple:
    """A node's Ray temp dir as `ray start --temp-dir` and its workers leave it: a session with its
    daemons' logs (session_latest a symlink to it), a socket folder, and the workers' TMPDIR with
    vLLM's rendezvous file."""
    temp = root / "ray_local-1_0_0"
    session = temp / "session_2026-01-01_00-00-00_000000_1"
    (session / "logs").mkdir(parents=True)
    (session / "logs" / "raylet.out").write_text("raylet log\n")
    (session / "logs" / "gcs_server.err").write_text("")            # empty: not kept
    (session / "sockets").mkdir()
    (temp / "session_latest").symlink_to(session)
    (temp / "tmp").mkdir()
    (temp / "tmp" / "vllm_dist_0123abcd").write_text("rendezvous")
    run = root / "run"
    run.mkdir(mode=0o700)
    return temp, session.name, run / "logs" / "ray" / "vm"


def test_a_killed_bootstraps_reaper_removes_the_ray_temp_dir_and_keeps_the_daemons_logs(tmp_path):
    temp, session, kept = _ray_temp_dir(tmp_path)
    marker = _marker()
    cmd = _reaper_cmd(0, marker, "sleep 300")
    cmd[3:3] = [f"--temp-dir={temp}", f"--keep-logs={kept}"]
    start = f"import os, subprocess, time; c = {cmd!r}; c[5] = str(os.getpid()); subprocess.Popen(c); time.sleep(300)"
    bootstrap = subprocess.Popen([sys.executable, "-c", start])
    assert _wait(lambda: _marked(marker))
    bootstrap.kill()
    bootstrap.wait()
    assert _wait(lambda: not temp.exists()), sorted(temp.rglob("*"))
    assert [p.relative_to(kept).as_posix() for p in sorted(kept.rglob("*"))] == [session, f"{session}/raylet.out"]
    assert (kept / session / "raylet.out").read_text() == "raylet log\n"
    assert oct((kept / session / "raylet.out").stat().st_mode & 0o777) == "0o600"  # the run directory's policy


def test_when_cmd_ends_by_itself_the_temp_dir_is_left_to_the_bootstrap(tmp_path):
    """The bootstrap still reads the daemons' logs for its message, then cleans up (ray_node.stop_node)."""
    temp, _, kept = _ray_temp_dir(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cluster.reaper", f"--temp-dir={temp}",
                             f"--keep-logs={kept}", str(psutil.Process().pid), "true"])
    assert proc.wait(timeout=30) == 0
    assert (temp / "tmp" / "vllm_dist_0123abcd").exists() and not kept.exists()
    reaper.clean_up(temp, kept)
    assert not temp.exists() and (kept / next(kept.iterdir()).name / "raylet.out").is_file()


def test_a_ctrl_c_during_the_clean_up_is_handled_after_it():
    """stop_node runs under stop.ctrl_c_held: the second Ctrl-C of "stop now" arriving while the node's
    Ray is being stopped must not leave its temp dir behind; it still ends the run, afterwards."""
    script = ("import os, signal, time\n"
              "from launcher.cluster import stop\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (xdist's workers ignore it)\n"
              "try:\n"
              "    with stop.ctrl_c_held():\n"
              "        os.kill(os.getpid(), signal.SIGINT)\n"
              "        time.sleep(0.3)\n"
              "        print('clean-up finished', flush=True)\n"
              "except KeyboardInterrupt:\n"
              "    print('then KeyboardInterrupt', flush=True)\n"
              "os.kill(os.getpid(), signal.SIGINT)  # the handler in place before is back\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["clean-up finished", "then KeyboardInterrupt"], out.stderr
    assert out.returncode == -signal.SIGINT and out.stderr.rstrip().endswith("KeyboardInterrupt")
