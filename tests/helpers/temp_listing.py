"""What a whole test run leaves in the system temp dir: nothing but what it keeps on purpose.

`pytest tests` (or a whole tier: `pytest tests/slurm`) lists the temp dir when it starts and again
when it ends (tests/conftest.py); an entry that is new and still there fails the run, named. Every process the suite starts has a temp dir of its
own that goes with it: a launcher run's Ray nodes (/tmp/ray_<job>_<attempt>_<node>, removed by the
reaper or, for a cancelled Slurm step, by srun's task epilog: launcher.cluster.task_epilog), the local
Ray of the integration tier (its TMPDIR too: vLLM's vllm_dist_* files), each `vllm serve`
(tests/helpers/vllm_server.py). Kept on purpose (KEPT): pytest's own base temp, torch's compile cache
(shared by a user's runs by design: launcher.cluster.ray_node.worker_tmp_env) and the Slurm test
cluster's root and lock (its daemons' logs stay for reading after a failure; up.sh starts afresh).
"""

from __future__ import annotations

import os
import tempfile

KEPT = ("pytest-of-", "torchinductor_", "slurm-test")


def listing() -> set[str]:
    return set(os.listdir(tempfile.gettempdir()))


def left_behind(before: set[str]) -> list[str]:
    """The entries of the temp dir that were not there in `before` and are not KEPT, as full paths."""
    root = tempfile.gettempdir()
    return sorted(os.path.join(root, n) for n in listing() - before if not n.startswith(KEPT))
