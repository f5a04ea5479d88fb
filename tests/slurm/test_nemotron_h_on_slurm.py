"""The reference model's family as a Slurm job: the tiny Nemotron-H (Mamba-2 + attention + MoE with a
shared expert and a router expert bias) on slurm_3n: 2 training nodes, one trainer rank each, at EP 2
(2 of the 4 routed experts on each node; TP 2 with sequence parallel, as slurm_3n trains), 1
generation node, refit merged_delta (tests/e2e/test_nemotron_h_local.py runs merged). It finishes
with exact refits on every step (the expert bias stays frozen: merged_delta never sends it) and
checkpoints both nodes wrote. (A preemption and its resume are the dense job's:
tests/slurm/test_branch_resume_on_slurm.py; a Nemotron-H checkpoint resumed at another layout:
tests/integration/test_nemotron_h.py.) This is the suite's one job with experts split across nodes:
what crosses the nodes (the experts' all-to-all, the expert-sharded checkpoint, the merged_delta
refit of sharded experts) is the same for every MoE family, and the Qwen3-MoE recipe runs at EP 2
in tests/e2e/test_moe_local.py and tests/integration/test_moe.py."""

from __future__ import annotations


import pytest

from tests.helpers.preemption import finished
from tests.helpers.slurm_jobs import submit

pytestmark = pytest.mark.slurm
STEPS = 6


def test_nemotron_h_job_at_ep2_over_two_nodes_finishes_with_exact_refits_and_checkpoints(slurm_cluster, tmp_path):
    submitted = submit(tmp_path, "topology=slurm_3n", "model=tiny_nemotron_h",
                       "topology.train.expert_parallel=2", "refit=merged_delta",
                       "run.name=nh", f"grpo.max_num_steps={STEPS}", "grpo.max_new_tokens=8",
                       "checkpointing.save_period=3", "checkpointing.keep_top_k=null",
                       "+slurm.extra_sbatch.nodelist='node[1-3]'", "logging.tensorboard=false")
    job, run = submitted.id, tmp_path / "nh"
    assert submitted.run == run
    plan = (run / "plan.txt").read_text()
    assert "EP 2" in plan, plan
    rows = finished(slurm_cluster, job, run, STEPS)
    # the generator got exactly the trained weights on every step (step 1: those it loaded, the trainers' W_0)
    assert all(r["train/gen_kl_error"] < 1e-5 and (r["refit/bytes"] > 0) == (r["step"] > 1) for r in rows), rows
