"""The driver: runs on node 0 once the Ray cluster has formed.

`run.job=placement_smoke` places one probe actor per trainer rank and vLLM engine and checks
each landed on its planned node (the launcher's own health check). `run.job=hold` does the same,
then keeps the cluster up (to attach a driver with the job's token) until `touch RUN/release`
or the time limit. The GRPO loop lands here next.
"""

from __future__ import annotations

import time

from launcher import placement, topology
from launcher.bootstrap import JobContext, log
from launcher.schema import Config


def run(cfg: Config, plan: topology.Plan, ctx: JobContext) -> dict:
    if cfg.run.job == "grpo":
        raise NotImplementedError("the GRPO loop is not built yet; use run.job=placement_smoke")
    report = placement.smoke(plan, ctx.hostnames, ctx.run_dir / "placement.json")
    log(f"placement smoke: {len(report['actors'])} actors on their planned nodes in {report['seconds']}s")
    if cfg.run.job == "hold":
        release = ctx.run_dir / "release"
        log(f"holding the cluster: attach with RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={ctx.rendezvous / 'token'}; "
            f"end with: touch {release}")
        while not release.exists():
            time.sleep(1.0)
        release.unlink()
    return report
