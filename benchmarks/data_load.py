"""Prompt-set loading benchmark: a large JSONL through launcher.driver.data (HF datasets' json
loader -> memory-mapped Arrow) beside a plain `json` read of the same file into Python dicts.

It writes a JSONL of `--records` records (a prompt of ~20 words, an answer, an id and a nested
field, like a real math set) into a temporary directory, then, each in a fresh process so the
peak resident memory (ru_maxrss) is that reader's alone:

  json            open + json.loads per line into a list of dicts (what a naive loader does)
  datasets cold   PromptDataset(path): the file converted to Arrow in the HF datasets cache
  datasets warm   PromptDataset(path) again: the cached Arrow file memory-mapped
  + serve         the warm load, then --batches batches of 8 prompts through take() (the first
                  take builds the epoch's permutation of every record)

and prints seconds and peak MiB per row. The cache lives in the temporary directory
(HF_DATASETS_CACHE), so "cold" is cold on every run.

    python benchmarks/data_load.py [--records 1000000] [--batches 200]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, resource, sys, time
sys.path.insert(0, {repo!r})
mode, path, batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
t = time.perf_counter()
if mode == "json":
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    n = len(rows)
    served = 0
else:
    from launcher.config.schema import Data
    from launcher.driver import data
    ds = data.PromptDataset(path, 0, Data(train=path))
    n = len(ds)
    load = time.perf_counter() - t
    served, pos = 0, 0
    for _ in range(batches):
        ex, pos, _skipped = ds.take(pos, 8)
        served += len(ex)
load_s = time.perf_counter() - t if mode == "json" else load
total = time.perf_counter() - t
print(json.dumps({{"records": n, "load_s": load_s, "total_s": total, "served": served,
                   "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
'''


def write(path: Path, n: int) -> None:
    rng = random.Random(0)
    words = ["what", "is", "the", "sum", "of", "and", "if", "a", "train", "leaves", "at", "speed", "find", "x"]
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            prompt = " ".join(rng.choice(words) for _ in range(16)) + f" {a} + {b} ?"
            f.write(json.dumps({"id": i, "prompt": prompt, "answer": str(a + b),
                                "meta": {"source": "synthetic", "level": i % 5}}) + "\n")


def measure(mode: str, path: Path, batches: int, env: dict) -> dict:
    code = CHILD.format(repo=str(REPO))
    out = subprocess.run([sys.executable, "-c", code, mode, str(path), str(batches)], capture_output=True,
                         text=True, env=env, timeout=3600)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--batches", type=int, default=200)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="data_load.") as tmp:
        path = Path(tmp) / "prompts.jsonl"
        t = time.perf_counter()
        write(path, a.records)
        print(f"wrote {a.records:,} records ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t:.1f}s")
        env = {**os.environ, "HF_DATASETS_CACHE": str(Path(tmp) / "hf_cache"), "OMP_NUM_THREADS": "1"}
        rows = [("json (list of dicts)", measure("json", path, 0, env)),
                ("datasets cold (-> Arrow cache)", measure("datasets", path, 0, env)),
                ("datasets warm (mmap)", measure("datasets", path, 0, env)),
                (f"datasets warm + {a.batches} batches of 8", measure("datasets", path, a.batches, env))]
    print(f"\n{'reader':<36} {'records':>10} {'load s':>8} {'total s':>8} {'peak MiB':>9}")
    for name, r in rows:
        if "error" in r:
            print(f"{name:<36} failed: {r['error']}")
            continue
        print(f"{name:<36} {r['records']:>10,} {r['load_s']:>8.2f} {r['total_s']:>8.2f} {r['peak_mib']:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
