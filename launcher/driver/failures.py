"""Failures during a run, said in one line: which actor (role, rank, node, pid) died, in which
phase of which step, and whether its node left the cluster with it."""

from __future__ import annotations

import time

from launcher import plan as plan_mod
from launcher.cluster.context import ClusterError, JobContext, check_reports, doing


class StepFailed(ClusterError):
    """A step could not finish: names the role, rank, node and phase."""


def actor_names(ctx: JobContext, plan: plan_mod.Plan, trainers, generators) -> dict[str, str]:
    """Ray actor id -> 'trainer rank 1 on node2 (pid 123)' for every actor of the run.

    `ActorHandle._actor_id` is private Ray API, but it is what RayActorError.actor_id names (a hex
    string); Ray offers no public handle -> id mapping on the driver side."""
    names = {}
    for r, actor in enumerate(getattr(trainers, "actors", [])):
        pid = trainers.infos[r]["pid"] if getattr(trainers, "infos", None) else "?"
        names[actor._actor_id.hex()] = f"trainer rank {r} on {ctx.hostnames[plan.trainer_node(r)]} (pid {pid})"
    for e, actor in enumerate(getattr(generators, "actors", [])):
        pid = generators.infos[e].get("pid", "?") if getattr(generators, "infos", None) else "?"
        names[actor._actor_id.hex()] = f"vLLM engine {e} on {ctx.hostnames[plan.engine_nodes(e)[0]]} (pid {pid})"
    return names


def describe(e: BaseException, ctx: JobContext, plan: plan_mod.Plan, trainers, generators) -> str:
    """One line: which actor failed, how, and in which phase of which step."""
    import ray

    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, ray.exceptions.RayActorError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:  # a peer's death often reaches the driver first as the survivors' failed collective
        from workers.trainer.group import task_error_line

        dead = dead_actor(ctx, plan, trainers, generators)
        if dead:
            return f"{dead[0]} died{doing(ctx)}: {dead[1]}{lost_node(ctx, plan)} (then: {task_error_line(e)})"
    if cause is None and isinstance(e, ray.exceptions.RayTaskError):  # a remote call raised: its exception
        where = f" (pid {e.pid}, {e.ip})" if getattr(e, "pid", None) else ""
        # a peer's node going makes a collective fail on the ranks that survive: name the node too
        return (f"{getattr(e, 'function_name', 'a remote call')}{where} failed{doing(ctx)}: {task_error_line(e)}"
                f"{lost_node(ctx, plan)}")
    first = (str(cause or e).strip().splitlines() or [type(e).__name__])[0]
    if isinstance(cause, ray.exceptions.RayActorError):
        who = actor_names(ctx, plan, trainers, generators).get(getattr(cause, "actor_id", None) or "", "an actor")
        return f"{who} died{doing(ctx)}: {first}{lost_node(ctx, plan)}"
    return f"{type(e).__name__}{doing(ctx)}: {first}{lost_node(ctx, plan)}"  # e.g. TrainerGroupError


def dead_actor(ctx: JobContext, plan: plan_mod.Plan, trainers, generators,
               wait_s: float = 5.0) -> tuple[str, str] | None:
    """(name, Ray's first line) of an actor of the run that is dead, else None. Each actor is asked
    Ray's built-in `__ray_ready__`: a dead one's answer is a RayActorError as soon as Ray knows of the
    death (its raylet notices the process go, within a second or so), an idle live one answers at once,
    a busy one not at all (it is waited for at most `wait_s`: only on the way to an error)."""
    import ray

    actors = [*getattr(trainers, "actors", []), *getattr(generators, "actors", [])]
    if not actors:
        return None
    names = actor_names(ctx, plan, trainers, generators)
    try:
        pings = {actor.__ray_ready__.remote(): actor for actor in actors}
        pending, deadline = list(pings), time.time() + wait_s
        while pending and time.time() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.time()))
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.ActorDiedError as err:
                    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
                    return names.get(pings[ref]._actor_id.hex(), "an actor"), first
                except Exception:  # noqa: BLE001 - unavailable (its node may be going), not known dead
                    continue
    except Exception:  # noqa: BLE001 - Ray itself is going (its head lost): the nodes' reports say why
        return None
    return None


def lost_node(ctx: JobContext, plan: plan_mod.Plan, wait_s: float = 5.0) -> str:
    """'; node 2 (node3, generation) left the Ray cluster: ...' when an actor died with its node, or
    a collective failed because a peer's did, else ''. From the nodes' own reports (each node's
    bootstrap writes one within a second or two of its Ray stopping; Ray's node list would lag by
    its health check, and a dead GCS does not answer it): this never asks Ray."""
    deadline = time.time() + wait_s
    while True:
        try:
            check_reports(ctx, plan)
        except ClusterError as e:
            return f"; {str(e).replace(doing(ctx), '')}"
        if time.time() > deadline or not ctx.rendezvous.is_dir():  # no rendezvous: no node reports
            return ""
        time.sleep(0.5)
