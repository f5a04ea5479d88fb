"""How many processes the tests started, of which kind, and their CPU seconds: where the suite's
minutes go (docs/testing.md, issue 43).

`pytest tests` (or a whole tier) sets SUITE_PROCESS_LOG to a private folder and puts
tests/helpers/process_probe first on PYTHONPATH (`enable`); every Python interpreter started
below it, on this machine or on a node of the Slurm test cluster, writes one record there
(process_probe/sitecustomize.py). At the end, `table` reads them, sorts each process into a kind
and charges it to the test module that started it: a unit test's subprocess by the test it
inherited in PYTEST_CURRENT_TEST; everything else (Ray workers inherit their raylet's
environment, Slurm jobs their submitter's, so that test may be an earlier one of the same stream)
by the time it started, to the test of that stream that was running then (a stream's tests run
one at a time, on one worker: tests/helpers/tiers.py).

Kinds (a process counts once, in the first that fits):
  launcher    `python -m launcher ...` (a run, a dry run, status/stop)
  ray node    `ray start` (a node's GCS/raylet; the in-process `ray.init` of `local_ray` is not one)
  megatron    any other process that imported megatron.core: trainer actors, conversions
  vllm        any other process that imported vllm: engines, `vllm serve`, exports checked by vLLM
  ray worker  any other Ray worker process (reward workers, helpers)
  python      any other Python interpreter (pytest's own workers are left out)
and `slurm jobs` counts the distinct Slurm jobs whose processes were seen.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

ENV = "SUITE_PROCESS_LOG"
PROBE = Path(__file__).resolve().parent / "process_probe"
KINDS = ("launcher", "ray node", "megatron", "vllm", "ray worker", "python")
EXECNET = "import sys;exec(eval(sys.stdin.readline()))"  # how execnet's popen starts an xdist worker


def enable(environ=os.environ) -> str:
    """Start counting: a private folder for the records, named in `environ` with the probe on
    PYTHONPATH (so every interpreter started from here on writes one). Returns the folder."""
    folder = tempfile.mkdtemp(prefix="suite-processes-")
    environ[ENV] = folder
    environ["PYTHONPATH"] = os.pathsep.join([str(PROBE), *filter(None, [environ.get("PYTHONPATH")])])
    return folder


def disable(folder: str, environ=os.environ) -> None:
    """Stop counting and remove the records."""
    environ.pop(ENV, None)
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(PROBE)]
    if parts:
        environ["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        environ.pop("PYTHONPATH", None)
    shutil.rmtree(folder, ignore_errors=True)


def records(folder: str) -> list[dict]:
    """Every process's record: its start line merged with its last sample (absent: no sample yet)."""
    out = []
    for path in sorted(Path(folder).iterdir()):
        try:
            lines = path.read_text(errors="replace").splitlines()
            rec = json.loads(lines[0])
            if len(lines) > 1 and lines[1].strip():
                rec.update(json.loads(lines[1]))
        except (OSError, ValueError, IndexError):
            continue
        out.append(rec)
    return out


def kind(rec: dict) -> str | None:
    """The kind of one process (KINDS), None for pytest's own processes."""
    cmd = rec.get("cmd", [])
    args = [os.path.basename(a) for a in cmd[1:]]
    mods = rec.get("mods", "000")
    if "pytest" in args or EXECNET in cmd:  # pytest, or one of xdist's workers (execnet starts them so)
        return None
    if "-m" in args and args[args.index("-m") + 1:][:1] == ["launcher"]:
        return "launcher"
    if "ray" in args and "start" in args:
        return "ray node"
    if mods[0] == "1":
        return "megatron"
    if mods[1:2] == "1":
        return "vllm"
    if rec.get("title", "").startswith("ray::") or "default_worker.py" in args:
        return "ray worker"
    return "python"


def _phases(reports: list) -> dict[str, list[tuple[float, float, str]]]:
    """{stream: [(start, stop, module) of every phase of its tests, by start]} outside the unit tier."""
    from tests.helpers.tiers import stream_of, tier_of

    out: dict[str, list] = defaultdict(list)
    for r in reports:
        tier = tier_of(r.nodeid)
        if tier != "unit" and getattr(r, "start", None) and getattr(r, "stop", None):
            out[stream_of(tier)].append((r.start, r.stop, r.nodeid.split("::", 1)[0]))
    return {stream: sorted(rows) for stream, rows in out.items()}


def module_of(rec: dict, phases: dict) -> str:
    """The test module that started a process (see the module's docstring): the test it inherited
    names the stream (the streams run side by side: tests/helpers/tiers.py), the time the module."""
    from tests.helpers.tiers import stream_of, tier_of

    test = rec.get("test", "").rsplit(" (", 1)[0]
    if not test:
        return "(outside any test)"
    tier = tier_of(test)
    if tier == "unit":
        return test.split("::", 1)[0]
    t0, module = rec.get("t0", 0.0), None
    for start, _stop, mod in phases.get(stream_of(tier), []):
        if start > t0:
            break
        module = mod
    return module or test.split("::", 1)[0]


def counts(recs: list[dict], reports: list) -> dict[str, dict]:
    """{module: {kind: [n, cpu s], ..., "slurm jobs": n, "cpu": s}} for every module that started one of `recs`."""
    phases = _phases(reports)
    per: dict[str, dict] = defaultdict(lambda: {**{k: [0, 0.0] for k in KINDS}, "slurm jobs": set(), "cpu": 0.0})
    for rec in recs:
        k = kind(rec)
        if k is None:
            continue
        row, cpu = per[module_of(rec, phases)], float(rec.get("cpu", 0.0))
        row[k][0] += 1
        row[k][1] += cpu
        row["cpu"] += cpu
        if rec.get("slurm_job"):
            row["slurm jobs"].add(rec["slurm_job"])
    return {m: {**row, "slurm jobs": len(row["slurm jobs"])} for m, row in per.items()}


def commands(recs: list[dict], kinds=("python", "ray worker"), n: int = 8) -> list[str]:
    """What the processes of `kinds` were, most CPU first: 'cpu s, count, title' (the script or
    module run, or the Ray actor's name), so that no kind is a place where minutes hide."""
    per: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for rec in recs:
        if kind(rec) in kinds:
            cmd = rec.get("cmd", [])
            title = rec.get("title", "")
            if not title.startswith("ray::"):
                rest = [a for a in cmd[1:] if not a.startswith("-")]
                title = ("-m " + cmd[cmd.index("-m") + 1] if "-m" in cmd[:-1] else "-c" if "-c" in cmd
                         else os.path.basename(rest[0]) if rest else "python")
            per[title[:40]][0] += float(rec.get("cpu", 0.0))
            per[title[:40]][1] += 1
    ranked = sorted(per.items(), key=lambda kv: -kv[1][0])[:n]
    return [f"{cpu:7.0f} s {count:5d} x  {title}" for title, (cpu, count) in ranked]


def table(folder: str, reports: list, n: int = 25) -> list[str]:
    """The printed table: one line per tier, then the `n` modules of most CPU seconds; a cell is
    'processes/CPU seconds' of that kind. Then what the processes of no named kind were."""
    from tests.helpers.tiers import TIERS, tier_of

    recs = records(folder)
    per = counts(recs, reports)
    head = f"{'':44s}" + "".join(f"{c:>13s}" for c in KINDS) + f"{'slurm jobs':>11s}{'CPU s':>8s}"

    def line(name: str, row: dict) -> str:
        cells = "".join(f"{f'{row[k][0]}/{row[k][1]:.0f}':>13s}" for k in KINDS)
        return f"{name[-44:]:44s}{cells}{row['slurm jobs']:11d}{row['cpu']:8.0f}"

    tiers: dict[str, dict] = {}
    for module, row in per.items():
        t = tiers.setdefault(tier_of(module + "::x"), {**{k: [0, 0.0] for k in KINDS}, "slurm jobs": 0, "cpu": 0.0})
        for k in KINDS:
            t[k] = [t[k][0] + row[k][0], t[k][1] + row[k][1]]
        t["slurm jobs"] += row["slurm jobs"]
        t["cpu"] += row["cpu"]
    lines = [head]
    lines += [line(f"tier {t}", tiers[t]) for t in sorted(tiers, key=lambda t: TIERS.index(t) if t in TIERS else 99)]
    lines.append("")
    lines += [line(m, row) for m, row in sorted(per.items(), key=lambda kv: -kv[1]["cpu"])[:n]]
    other = commands(recs)
    if other:
        lines += ["", "the ray workers and other Python processes, most CPU first:", *other]
    return lines
