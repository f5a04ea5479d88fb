"""Two runs on one run directory: a local run holds RUN/.in_use while its process lives, and a second
launch on that directory (here: another process) is refused in one line naming the holder, before
anything in the directory changes; once the holder has ended, the directory is free again."""

from __future__ import annotations

import os
import subprocess
import sys

PY = sys.executable
HOLDER = """
import sys, time
from pathlib import Path
from launcher.config.compose import compose
from launcher.config.schema import typed
from launcher.job import run_dir
cfg = typed(compose([f"run.root={sys.argv[1]}"]))
d = Path(sys.argv[1]) / "local-tiny_llama"
d.mkdir(parents=True)
run_dir.hold(cfg, d, keep=True)
print("holding", flush=True)
time.sleep(120)
"""


def launch(root, *extra):
    return subprocess.run([PY, "-m", "launcher", f"run.root={root}", "submit=false", *extra], capture_output=True,
                          text=True, timeout=120)


def test_a_second_launch_on_a_run_directory_in_use_is_refused(tmp_path):
    holder = subprocess.Popen([PY, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        p = launch(tmp_path)
        assert p.returncode == 2, p.stdout + p.stderr
        err = p.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: run.name: {tmp_path}/local-tiny_llama is in use by a run "
                                                   f"on this machine (pid {holder.pid} on "), err
        assert "Traceback" not in p.stderr
        assert not (tmp_path / "local-tiny_llama" / "config.yaml").exists()  # nothing written
    finally:
        holder.kill()
        holder.wait()
    p = launch(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "local-tiny_llama" / "config.yaml").is_file()
    assert oct(os.stat(tmp_path / "local-tiny_llama" / ".in_use").st_mode & 0o777) == "0o600"
