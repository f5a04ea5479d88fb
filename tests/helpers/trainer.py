"""Test-only trainer: a MegatronTrainer with probes the production actor does not need.

    TrainerGroup(config, num_ranks=2, actor_cls=ProbedTrainer)

Ray workers import this module by its path (the driver's working directory is on their path).
"""

from __future__ import annotations

from workers.trainer.actor import MegatronTrainer


class ProbedTrainer(MegatronTrainer):
    def parameters_snapshot(self) -> dict:
        """{name: this rank's local tensor} of every parameter."""
        return {n: p.detach().float().cpu().clone() for n, p in self._module.named_parameters()}

    def export_unmerged_state(self, keep: bool | str = True):
        """export_merged_state() without merging the adapters: the refit guard must refuse the
        `...base_layer...` names Megatron-Bridge exports then."""
        pairs = list(self._export_hf(merge_adapters=False))
        return pairs if keep is True or (keep == "rank0" and self.rank == 0) else None

    def expert_biases(self) -> dict:
        """{name: this rank's MoE router expert bias} (a buffer, not a parameter)."""
        return {n: b.detach().cpu().clone() for n, b in self._module.named_buffers() if n.endswith(".expert_bias")}
