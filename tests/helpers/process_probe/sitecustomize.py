"""Counts the Python processes a test run starts (tests/helpers/process_counts.py).

Python imports this module at the start of every interpreter whose PYTHONPATH holds this folder;
it does something only when SUITE_PROCESS_LOG names a folder (set by tests/conftest.py for
`pytest tests` or a whole tier). It then writes one file there for this process: a first line
with what is known at start (pid, the command line, the test that ran when it started, the Slurm
job), then, once a second and at exit, a line with its CPU seconds so far, its process title (Ray
renames its workers `ray::<Actor>...`) and whether megatron.core, vllm or ray is imported: the
cold starts. A process killed with SIGKILL keeps its last line (at most a second of CPU lost).
Standard library only, and nothing imported that an interpreter would not import anyway but
`threading`, so a fresh interpreter's imports stay what the tests of import rules expect.
"""

import os

_DIR = os.environ.get("SUITE_PROCESS_LOG")


def _start(directory: str) -> None:
    import atexit
    import json
    import sys
    import threading
    import time

    pid = os.getpid()
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        fd = os.open(os.path.join(directory, f"{pid}-{time.time_ns()}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return
    head = {"pid": pid, "ppid": os.getppid(), "t0": time.time(),
            "cmd": [c.decode(errors="replace") for c in cmd if c][:8],
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
            "slurm_job": os.environ.get("SLURM_JOB_ID", "")}
    first = (json.dumps(head) + "\n").encode()
    os.write(fd, first)
    width = 200

    def sample() -> None:
        if os.getpid() != pid:  # a fork's atexit: not this process's record
            return
        t = os.times()
        try:
            title = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")[:80]
        except OSError:
            title = ""
        mods = "".join("1" if m in sys.modules else "0" for m in ("megatron.core", "vllm", "ray"))
        line = json.dumps({"cpu": round(t.user + t.system, 2), "t": round(time.time(), 1),
                           "title": title, "mods": mods}).encode()[:width - 1].ljust(width - 1) + b"\n"
        try:
            os.pwrite(fd, line, len(first))
        except OSError:
            pass

    def loop() -> None:
        while True:
            time.sleep(1.0)
            sample()

    threading.Thread(target=loop, name="suite-process-probe", daemon=True).start()
    atexit.register(sample)


if _DIR and os.path.isdir(_DIR) and os.getpid() != 1:
    _start(_DIR)
