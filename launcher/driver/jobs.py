"""The driver's job kinds: what node 0 runs once the Ray cluster has formed (`run.job`).

`grpo` (the default) runs launcher.driver.grpo. `placement_smoke` places one probe actor per
trainer rank and vLLM engine and checks each landed on its planned node (the launcher's own health
check). `hold` does the same, then keeps the cluster up (to attach a driver with the job's token)
until `touch RUN/release` or the time limit. `preflight`: the bootstrap has checked every node
before Ray started (launcher.cluster.preflight, RUN/preflight.json); the driver then runs the
placement smoke of the real run's actors.

Kept out of driver/__init__.py: a package whose __init__ imports its own modules makes every
`from launcher.driver import x` a cycle through it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from launcher import logs, paths, shell
from launcher import plan as plan_mod
from launcher.cluster.context import JobContext
from launcher.config.schema import Config

log = logs.get(__name__).info


def run(cfg: Config, plan: plan_mod.Plan, ctx: JobContext, stop: threading.Event) -> dict:
    if cfg.run.job == "grpo":
        from launcher.driver import grpo

        return grpo.run(cfg, plan, ctx, stop)
    from launcher.driver import smoke

    report = smoke.run(plan, ctx.hostnames, ctx.run_dir / paths.PLACEMENT)
    if cfg.run.job == "preflight":
        log(f"preflight passed: {len(ctx.hostnames)} node(s) checked, {len(report['actors'])} actors on their "
            f"planned nodes in {report['seconds']}s")
        return {"preflight": json.loads((ctx.run_dir / paths.PREFLIGHT_REPORT).read_text()), "placement": report}
    log(f"placement smoke: {len(report['actors'])} actors on their planned nodes in {report['seconds']}s")
    if cfg.run.job == "hold":
        release = ctx.run_dir / paths.RELEASE
        log(f"holding the cluster: {hold_hint(ctx.rendezvous / paths.TOKEN, release)}")
        while not release.exists() and not stop.is_set():
            time.sleep(1.0)
        release.unlink(missing_ok=True)
    return report


def hold_hint(token: Path, release: Path) -> str:
    """How to attach to a held cluster and end the hold: two commands to paste (launcher.shell)."""
    env = f"{shell.assignment('RAY_AUTH_MODE', 'token')} {shell.assignment('RAY_AUTH_TOKEN_PATH', token)}"
    return f"attach with: {env} ray status   end with: {shell.command('touch', release)}"
