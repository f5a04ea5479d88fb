"""The reference model's family as a Slurm job: the tiny Nemotron-H (Mamba-2 + attention + MoE with a
shared expert and a router expert bias) on slurm_3n: 2 training nodes, one trainer rank each, at EP 2
(2 of the 4 routed experts on each node; TP 2 with sequence parallel, as slurm_3n trains), 1
generation node, refit merged_delta (tests/e2e/test_nemotron_h_local.py runs merged). Preempted
mid-run, it checkpoints, requeues itself, resumes and finishes with no step lost or repeated and
exact refits on every step (the expert bias stays frozen: merged_delta never sends it)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers.held_step import HELD_REWARD
from tests.helpers.preemption import preempt_and_finish

pytestmark = pytest.mark.slurm
PY = sys.executable
STEPS = 6


def test_nemotron_h_job_at_ep2_over_two_nodes_preempted_resumes_and_finishes(slurm_cluster, tmp_path):
    p = subprocess.run([PY, "-m", "launcher", "topology=slurm_3n", "model=tiny_nemotron_h",
                        "topology.train.expert_parallel=2", "refit=merged_delta", f"run.root={tmp_path}",
                        "run.name=nh", f"grpo.max_num_steps={STEPS}", "grpo.max_new_tokens=8",
                        "checkpointing.save_period=3", "checkpointing.keep_top_k=null",
                        "+slurm.extra_sbatch.nodelist='node[1-3]'", "logging.tensorboard=false", *HELD_REWARD],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    job = re.search(r"submitted job (\d+)", p.stdout).group(1)
    run = tmp_path / "nh"
    plan = (run / "plan.txt").read_text()
    assert "EP 2" in plan, plan
    rows = preempt_and_finish(slurm_cluster, job, run, STEPS, train_timeout=600, finish_timeout=900)
    # the generator got exactly the trained weights on every step, before and after the resume
    assert all(r["train/gen_kl_error"] < 1e-5 and r["refit/bytes"] > 0 for r in rows), rows
