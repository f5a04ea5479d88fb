"""The placement plan: which node hosts which trainer ranks and which vLLM workers.

This is the one place for the topology arithmetic. The dry run prints the plan, the bootstrap
gives every Ray node the resources the plan assigns to it, and the driver pins each actor to
its planned node through those resources (`node_<i>`), so what is printed is what runs.

Nodes are ordered as Slurm lists them: the first `train.nodes` nodes train (node 0 also hosts
the Ray head and the driver), the rest generate. With `colocate_roles` (the local single-node
case) node 0 hosts both roles.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config.schema import GENERATION_SLOT, TRAIN_SLOT, ConfigError, Topology, train_parallel_errors
NODE_RESOURCE_UNITS = 1000  # `node_<i>` units per node; an actor asks for 1


def node_resource(index: int) -> str:
    return f"node_{index}"


@dataclass(frozen=True)
class NodePlan:
    index: int
    train_ranks: tuple[int, ...]
    generation_workers: tuple[tuple[int, int], ...]  # (engine, tensor-parallel rank)
    gpus: int

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r, on in (("train", self.train_ranks), ("generation", self.generation_workers)) if on)

    def ray_resources(self) -> dict[str, int]:
        res = {node_resource(self.index): NODE_RESOURCE_UNITS}
        if self.train_ranks:
            res[TRAIN_SLOT] = len(self.train_ranks)
        if self.generation_workers:
            res[GENERATION_SLOT] = len(self.generation_workers)
        return res


@dataclass(frozen=True)
class Plan:
    device: str
    nodes: tuple[NodePlan, ...]
    train_world: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    engines: int
    generation_tp: int

    def trainer_node(self, rank: int) -> int:
        return next(n.index for n in self.nodes if rank in n.train_ranks)

    def engine_nodes(self, engine: int) -> list[int]:
        return [n.index for n in self.nodes if any(e == engine for e, _ in n.generation_workers)]

    def describe(self, hostnames: list[str] | None = None) -> str:
        """A table: one line per node with its roles, trainer ranks and vLLM workers."""
        lines = [
            f"training: {self.train_world} ranks = TP {self.tp} x PP {self.pp} x CP {self.cp} x DP {self.dp}"
            f" (EP {self.ep}, ETP {self.etp}) on {self.device}",
            f"generation: {self.engines} vLLM engine(s) x TP {self.generation_tp}",
            f"{'node':<14} {'roles':<20} {'trainer ranks':<18} {'vLLM workers (engine:tp_rank)':<32} GPUs",
        ]
        for n in self.nodes:
            host = hostnames[n.index] if hostnames else f"node {n.index}"
            lines.append(f"{host:<14} {'+'.join(n.roles) + (' (head)' if n.index == 0 else ''):<20} "
                         f"{_ranges(n.train_ranks) or '-':<18} "
                         f"{' '.join(f'{e}:{r}' for e, r in n.generation_workers) or '-':<32} {n.gpus}")
        return "\n".join(lines)


def _ranges(xs: tuple[int, ...]) -> str:
    if not xs:
        return ""
    return f"{xs[0]}" if len(xs) == 1 else f"{xs[0]}-{xs[-1]}"


def check(t: Topology) -> list[ConfigError]:
    """Arithmetic rules of a topology whose every field is in its own range (launcher.config.ranges:
    executor, device, counts >= 1). Each failure names the key and what is allowed."""
    errs: list[ConfigError] = []
    tr, gen = t.train, t.generation

    def err(key: str, msg: str) -> None:
        errs.append(ConfigError(f"topology.{key}", msg))

    if t.executor == "local" and t.nodes != 1:
        err("nodes", f"the local executor runs on this machine: nodes must be 1, got {t.nodes}")
    elif t.colocate_roles:
        if (t.nodes, tr.nodes, gen.nodes) != (1, 1, 1):
            err("colocate_roles", "sharing a node between roles needs nodes = train.nodes = generation.nodes = 1")
    elif tr.nodes + gen.nodes != t.nodes:
        err("nodes", f"must equal train.nodes + generation.nodes = {tr.nodes} + {gen.nodes} = "
                     f"{tr.nodes + gen.nodes}, got {t.nodes}")
    if t.device == "cuda":
        if t.gpus_per_node < 1:
            err("gpus_per_node", "device cuda needs at least 1 GPU per node")
        for role, r in (("train", tr), ("generation", gen)):
            if r.ranks_per_node > t.gpus_per_node:
                err(f"{role}.ranks_per_node", f"one rank per GPU: at most gpus_per_node = {t.gpus_per_node}, "
                                              f"got {r.ranks_per_node}")
    world = tr.nodes * tr.ranks_per_node
    model_par = tr.tensor_parallel * tr.pipeline_parallel * tr.context_parallel
    if world % model_par:
        err("train.tensor_parallel", f"TP x PP x CP = {tr.tensor_parallel} x {tr.pipeline_parallel} x "
                                     f"{tr.context_parallel} = {model_par} must divide the {world} trainer ranks "
                                     f"(train.nodes x ranks_per_node); allowed TP: {_divisors(world)}")
    expert_par = tr.expert_parallel * tr.expert_tensor_parallel * tr.pipeline_parallel
    if world % expert_par:
        err("train.expert_parallel", f"EP x ETP x PP = {expert_par} must divide the {world} trainer ranks; "
                                     f"allowed EP: {_divisors(world // (tr.expert_tensor_parallel * tr.pipeline_parallel) or 1)}")
    errs += train_parallel_errors(tr)
    workers = gen.nodes * gen.ranks_per_node
    if gen.engines * gen.tensor_parallel != workers:
        err("generation.tensor_parallel", f"engines x TP = {gen.engines} x {gen.tensor_parallel} must equal the "
                                          f"{workers} vLLM workers (generation.nodes x ranks_per_node)")
    elif gen.tensor_parallel > gen.ranks_per_node and gen.tensor_parallel % gen.ranks_per_node:
        err("generation.tensor_parallel", f"an engine spanning nodes must use whole nodes: a multiple of "
                                          f"ranks_per_node = {gen.ranks_per_node}, got {gen.tensor_parallel}")
    elif gen.tensor_parallel < gen.ranks_per_node and gen.ranks_per_node % gen.tensor_parallel:
        err("generation.tensor_parallel", f"must divide ranks_per_node = {gen.ranks_per_node} (engines may not "
                                          f"straddle nodes), got {gen.tensor_parallel}")
    if t.device == "cpu" and gen.tensor_parallel != 1:
        err("generation.tensor_parallel", "vLLM on CPU runs in-process: must be 1")
    return errs


def _divisors(n: int) -> str:
    """The divisors of n, in O(sqrt n) (n is a product of config values: it can be large)."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return ", ".join(str(d) for d in sorted(set(small + [n // d for d in small])))


def build(t: Topology) -> Plan:
    """The plan of a topology that passed `check`."""
    tr, gen = t.train, t.generation
    gpus = t.gpus_per_node  # what Slurm allocates per node (fake GRES on the CPU test cluster)
    train_nodes = [0] if t.colocate_roles else list(range(tr.nodes))
    gen_nodes = [0] if t.colocate_roles else list(range(tr.nodes, tr.nodes + gen.nodes))
    ranks: dict[int, list[int]] = {i: [] for i in range(t.nodes)}
    for r in range(tr.nodes * tr.ranks_per_node):
        ranks[train_nodes[r // tr.ranks_per_node]].append(r)
    workers: dict[int, list[tuple[int, int]]] = {i: [] for i in range(t.nodes)}
    for w in range(gen.nodes * gen.ranks_per_node):
        workers[gen_nodes[w // gen.ranks_per_node]].append((w // gen.tensor_parallel, w % gen.tensor_parallel))
    nodes = tuple(NodePlan(i, tuple(ranks[i]), tuple(workers[i]), gpus) for i in range(t.nodes))
    world = tr.nodes * tr.ranks_per_node
    return Plan(device=t.device, nodes=nodes, train_world=world, tp=tr.tensor_parallel, pp=tr.pipeline_parallel,
                cp=tr.context_parallel, ep=tr.expert_parallel, etp=tr.expert_tensor_parallel,
                dp=world // (tr.tensor_parallel * tr.pipeline_parallel * tr.context_parallel),
                engines=gen.engines, generation_tp=gen.tensor_parallel)


# ------------------------------------------------------------------ actor placement
# Each Ray node carries `node_<i>` plus role slots; an actor asks for one role slot and one unit
# of its node's resource, so it can only land where the plan put it.
def trainer_options(plan: Plan, rank: int) -> dict:
    opts = {"num_cpus": 0, "resources": {TRAIN_SLOT: 1, node_resource(plan.trainer_node(rank)): 1}}
    if plan.device == "cuda":
        opts["num_gpus"] = 1
    return opts


def generator_options(plan: Plan, engine: int) -> dict:
    """The engine actor sits on the engine's first node. On cuda a TP=1 engine runs its one vLLM
    worker in the actor's process ("uni" executor) and takes that GPU. A TP>1 engine (one node or
    several, as ultra_6n4g's TP8 over 2 nodes) takes no GPU itself: RayExecutorV2 runs the engine's
    driver side in the actor and needs no GPU there (initialize_ray_cluster with
    require_gpu_on_driver=False); its vLLM workers take one each, in the placement group of
    `engine_bundles`, which the actor is started in (its bundle 0)."""
    nodes = plan.engine_nodes(engine)
    workers_here = sum(1 for n in plan.nodes if n.index == nodes[0] for e, _ in n.generation_workers if e == engine)
    opts: dict = {"num_cpus": 0,
                  "resources": {GENERATION_SLOT: workers_here, node_resource(nodes[0]): 1}}
    if plan.device == "cuda" and plan.generation_tp == 1:
        opts["num_gpus"] = 1
    return opts


def engine_bundles(plan: Plan, engine: int) -> list[dict] | None:
    """cuda, TP>1: the placement group a TP>1 engine's actor starts in (bundle 0) and vLLM's Ray
    executor (RayExecutorV2, vLLM 0.32's default) then takes as its own (it uses the current
    placement group: vllm/v1/executor/ray_utils.py initialize_ray_cluster): one {GPU: 1} bundle per
    vLLM worker in tp_rank order, each pinned to the node the plan gives that worker (`node_<i>`);
    bundle 0 also holds the actor's own resources (generator_options). The engine sets
    VLLM_RAY_BUNDLE_INDICES=0..TP-1 (workers.generator.actor), so vLLM's worker rank r is the one in
    bundle r: without it RayExecutorV2 ranks the actor's node first and the others by Ray node id,
    which is this order for two nodes only. Unpinned, vLLM would pack its group onto whichever GPUs
    are free when the engine starts, a training node's included when the trainers (started at the
    same time) have not claimed theirs yet. None where vLLM makes no group."""
    if plan.device != "cuda" or plan.generation_tp == 1:
        return None
    where = {rank: n.index for n in plan.nodes for e, rank in n.generation_workers if e == engine}
    bundles: list[dict] = [{"GPU": 1, node_resource(where[rank]): 1} for rank in range(plan.generation_tp)]
    for key, amount in generator_options(plan, engine)["resources"].items():
        bundles[0][key] = bundles[0].get(key, 0) + amount
    return bundles
