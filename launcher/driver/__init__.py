"""The driver: runs on node 0 once the Ray cluster has formed.

`run.job=placement_smoke` places one probe actor per trainer rank and vLLM engine and checks
each landed on its planned node (the launcher's own health check). `run.job=hold` does the same,
then keeps the cluster up (to attach a driver with the job's token) until `touch RUN/release`
or the time limit. `run.job=preflight` checks every node (GPUs, versions, shared paths, disk,
an all-reduce; launcher.driver.preflight), then the placement. `run.job=grpo` (the default) runs
launcher.driver.grpo.
"""

from __future__ import annotations

import threading
import time

from launcher import plan as plan_mod
from launcher.cluster.context import JobContext, log
from launcher.config.schema import Config


def run(cfg: Config, plan: plan_mod.Plan, ctx: JobContext, stop: threading.Event) -> dict:
    if cfg.run.job == "grpo":
        from launcher.driver import grpo

        return grpo.run(cfg, plan, ctx, stop)
    if cfg.run.job == "preflight":
        from launcher.driver import preflight

        return preflight.run(cfg, plan, ctx, stop)
    from launcher.driver import smoke

    report = smoke.run(plan, ctx.hostnames, ctx.run_dir / "placement.json")
    log(f"placement smoke: {len(report['actors'])} actors on their planned nodes in {report['seconds']}s")
    if cfg.run.job == "hold":
        release = ctx.run_dir / "release"
        log(f"holding the cluster: attach with RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={ctx.rendezvous / 'token'}; "
            f"end with: touch {release}")
        while not release.exists() and not stop.is_set():
            time.sleep(1.0)
        release.unlink(missing_ok=True)
    return report
