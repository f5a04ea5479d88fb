"""A Ray dashboard agent that starts late, once: what a busy node (or a slow shared filesystem)
does to the agent's imports. With this folder first on PYTHONPATH and SLOW_AGENT_ONCE naming a file
that does not exist yet, the first `ray.dashboard.agent` process started creates the file and
sleeps SLOW_AGENT_S seconds (default 25) before its imports; later ones start at once. Ray 2.60's
raylet aborts when the agent has not written its port files within 15 s, so the first `ray start`
on the node fails as it did in CI at a load of 30 (raylet.out: "Timed out waiting for file
.../dashboard_agent_listen_port_..."). Then the next sitecustomize on sys.path runs (the suite's
process probe, tests/helpers/process_probe), as Python imports only the first one it finds."""

import os


def _slow_once() -> None:
    marker = os.environ.get("SLOW_AGENT_ONCE")
    if not marker:
        return
    try:
        with open("/proc/self/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return
    if not any(w.replace(b"\\", b"/").endswith(b"dashboard/agent.py") for w in words):
        return
    try:
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return
    import time

    time.sleep(float(os.environ.get("SLOW_AGENT_S", "25")))


def _next_sitecustomize() -> None:
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    for d in sys.path:
        path = os.path.join(os.path.abspath(d or "."), "sitecustomize.py")
        if os.path.dirname(path) != here and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_sitecustomize_next", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_slow_once()
_next_sitecustomize()
