"""The reference topology on the local Slurm cluster: `topology=ultra_6n4g run.job=placement_smoke`
on 6 nodes with 4 fake GPUs each (GRES on device files; Ray is told the node has 4 GPUs) places
the 16 trainer ranks (TP2 / EP16, 4 per train node) and the TP8 engine's actor and its 8 vLLM
workers (4 per generation node, vLLM's own placement group) exactly where plan.txt says.

The model is the tiny stand-in of the reference model as released (Nemotron 3: Mamba-2 + attention +
LatentMoE + MTP layers), the built-in recipe tiny_nemotron3: the placement smoke builds no model, but
validation checks the model's facts against the topology (EP16 must divide the experts, TP8 the
attention heads, TP2 the KV groups, Mamba heads and groups: tests/helpers/nemotron_h.py)."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.slurm_jobs import submit

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]
NODES = 6
ROW = re.compile(r"^node (\d+)\s+(\S+)(?: \(head\))?\s+(\S+)\s+(.+?)\s+(\d+)$")


def read_plan(text: str) -> tuple[dict[int, int], dict[str, int], dict[int, int]]:
    """plan.txt -> (trainer rank -> node index, "engine:tp_rank" -> node index, node index -> GPUs)."""
    ranks, workers, gpus = {}, {}, {}
    for line in text.splitlines():
        m = ROW.match(line)
        if not m:
            continue
        node, _roles, train, gen, n_gpus = int(m[1]), m[2], m[3], m[4].strip(), int(m[5])
        if train != "-":
            lo, _, hi = train.partition("-")
            ranks.update({r: node for r in range(int(lo), int(hi or lo) + 1)})
        if gen != "-":
            workers.update({w: node for w in gen.split()})
        gpus[node] = n_gpus
    return ranks, workers, gpus


def test_ultra_6n4g_places_16_trainers_and_the_tp8_engine_where_the_plan_says(slurm_cluster, tmp_path):
    if len(slurm_cluster.nodes) < NODES:
        pytest.skip(f"needs a {NODES}-node test cluster, this one has {len(slurm_cluster.nodes)} (SLURM_TEST_NODES)")
    from tests.helpers.nemotron_h import ULTRA_STAND_IN

    # the test nodes have fewer cores than a GB200 node (the topology asks for 128): all of theirs; and the
    # test cluster's Slurm (Debian's 22.05) has no --segment (Slurm 24.05+): no NVLink domain here
    submitted = submit(tmp_path, "topology=ultra_6n4g", "run.job=placement_smoke", *ULTRA_STAND_IN,
                       f"topology.cpus_per_node={slurm_cluster.cpus_per_node}", "topology.nvlink_domain_nodes=null",
                       "logging.tensorboard=false")
    assert submitted.nodes == NODES, submitted.stdout
    job, run = submitted.id, submitted.run
    state = slurm_cluster.wait_job(job, timeout=480)
    d = run / "submitit" / job
    log = "".join(f.read_text() for f in sorted(d.glob(f"{job}_0_log.*")))
    assert state == "COMPLETED", log[-6000:]
    assert f"all {NODES} node(s) registered" in log

    # the job's nodes in Slurm's order: plan node i is the i-th of them
    nodelist = slurm_cluster.run("sacct", "-n", "-X", "-P", "-j", job, "-o", "NodeList").split()[0]
    hosts = slurm_cluster.run("scontrol", "show", "hostnames", nodelist).split()
    assert len(hosts) == NODES, hosts

    ranks, workers, gpus = read_plan((run / "plan.txt").read_text())
    assert sorted(ranks) == list(range(16)) and len({n for n in ranks.values()}) == 4, ranks
    assert sorted(workers) == [f"0:{r}" for r in range(8)] and sorted(set(workers.values())) == [4, 5], workers
    assert gpus == {i: 4 for i in range(NODES)}, gpus

    report = json.loads((run / "placement.json").read_text())
    actors = report["actors"]
    got = [(a["role"], a["index"], a["slurm_node"]) for a in actors]
    expected = ([("train", r, hosts[ranks[r]]) for r in range(16)]
                + [("generation", 0, hosts[workers["0:0"]])]   # the engine actor: its first node
                + [("vllm_worker", f"0:{r}", hosts[workers[f"0:{r}"]]) for r in range(8)])
    assert got == expected
    assert [a["planned_host"] for a in actors] == [h for *_, h in expected]   # the driver's plan = plan.txt
    assert all(a["hostname"] == a["slurm_node"] for a in actors)
    assert {a["slurm_node"] for a in actors if a["role"] == "vllm_worker"} == {hosts[4], hosts[5]}

    # each trainer rank and vLLM worker holds its own GPU: the 4 of its node, none shared
    for role in ("train", "vllm_worker"):
        per_node: dict[str, list[str]] = {}
        for a in actors:
            if a["role"] == role:
                assert len(a["gpu_ids"]) == 1, a
                per_node.setdefault(a["slurm_node"], []).extend(a["gpu_ids"])
        assert {h: sorted(g) for h, g in per_node.items()} == {h: ["0", "1", "2", "3"] for h in per_node}, per_node
    assert next(a for a in actors if a["role"] == "generation")["gpu_ids"] == []   # TP8: vLLM's workers hold them

    # the GPUs Ray sees on each node are the plan's
    assert [(n["index"], n["host"], n["gpus"]) for n in report["nodes"]] == [(i, hosts[i], gpus[i]) for i in range(NODES)]
    assert all(n["ip"] == slurm_cluster.addresses[n["host"]] for n in report["nodes"])
