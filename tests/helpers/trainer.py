"""Test-only trainer: a MegatronTrainer with probes the production actor does not need, and the
group that runs it on every rank.

    ProbedTrainerGroup(config, num_ranks=2)

Ray workers import this module by its path (the driver's working directory is on their path).
"""

from __future__ import annotations

import torch

from workers.trainer import gather
from workers.trainer.actor import MegatronTrainer
from workers.trainer.config import TrainerConfig
from workers.trainer.group import TrainerGroup


class ProbedTrainer(MegatronTrainer):
    def parameters_snapshot(self) -> dict:
        """{name: this rank's local tensor} of every parameter."""
        return {n: p.detach().float().cpu().clone() for n, p in self._module.named_parameters()}

    def export_merged_state(self, keep: bool | str = True):
        """export_merged() as a list of CPU tensors (returned by rank 0 only when keep='rank0'; the
        other ranks drain the collective export without keeping anything)."""
        if not (keep is True or (keep == "rank0" and self.rank == 0)):
            for _ in self.export_merged():
                pass
            return None
        return [(name, tensor.cpu()) for name, tensor in self.export_merged()]

    def optimizer_state(self) -> dict:
        """{name: {"exp_avg": full tensor, "exp_avg_sq": ..., "step": ...}} of the trainable parameters."""
        if self.cfg.use_distributed_optimizer:
            raise NotImplementedError("optimizer_state() reads the plain optimizer (not the distributed one)")
        state: dict = {}
        for inner in gather.torch_optimizers(self.optimizer):
            state.update(inner.state)
        trainable = {n: p for n, p in self._module.named_parameters() if p.requires_grad}
        keys = sorted({k for p in trainable.values() for k in state.get(p, {})})
        out: dict = {}
        for key in keys:
            full = gather.full_named(trainable, lambda name, param: _as_tensor(state[param][key]), self.ps,
                                     self.model_config)
            for name, tensor in full.items():
                out.setdefault(name, {})[key] = tensor
        return out

    def bridge_merged_state(self):
        """Megatron-Bridge's own merged export (export_hf_weights(merge_adapter_weights=True)), as
        CPU tensors on rank 0 (None elsewhere): what export_merged() must equal bitwise."""
        pairs = [(name, tensor.cpu()) for name, tensor in self._export_hf(merge_adapters=True)]
        return pairs if self.rank == 0 else None

    def export_unmerged_state(self, keep: bool | str = True):
        """export_merged_state() without merging the adapters: the refit guard must refuse the
        `...base_layer...` names Megatron-Bridge exports then."""
        pairs = list(self._export_hf(merge_adapters=False))
        return pairs if keep is True or (keep == "rank0" and self.rank == 0) else None

    def gradients(self, batch, only: str = "") -> dict:
        """{name: full (TP-gathered) gradient} of every trainable parameter (whose name contains `only`) for
        the GRPO loss of `batch`: train()'s forward and backward (the reduced main_grad megatron's optimizer
        would use), no update; the step counter and the scheduler are left as they were. Collective (every
        rank)."""
        grads: dict = {}
        trainable = {n: p for n, p in self._module.named_parameters() if p.requires_grad and only in n}

        def step():
            grads.update(gather.full_named(trainable, lambda name, param: param.main_grad.detach(), self.ps,
                                           self.model_config))
            return True, float("nan"), None

        self.optimizer.step, steps = step, self.scheduler.num_steps
        try:
            self.train(batch)
        finally:
            del self.optimizer.step   # the optimizer's own method again
            self.step -= 1
            self.scheduler.num_steps = steps
            self.scheduler.step(increment=0)
        return grads

    def expert_biases(self) -> dict:
        """{name: this rank's MoE router expert bias} (a buffer, not a parameter)."""
        return {n: b.detach().cpu().clone() for n, b in self._module.named_buffers() if n.endswith(".expert_bias")}


def _as_tensor(value):
    return value.detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value))


class ProbedTrainerGroup(TrainerGroup):
    """A TrainerGroup of ProbedTrainers, with calls of any method (the probes) on every rank."""

    ACTOR = ProbedTrainer

    def call(self, method: str, *args, **kwargs) -> list:
        """Run any ProbedTrainer method on every rank; answers in rank order."""
        return self._call(method, *args, **kwargs)

    def export_merged(self) -> list:
        """The merged export, rank 0's (the others drain the collective export)."""
        return self._call("export_merged_state", keep="rank0")[0]

    def optimizer_state(self) -> dict:
        return self._call("optimizer_state")[0]


def probed_group(model_dir, peft: dict, optim: dict, tp: int = 1, ep: int = 1, seed: int = 11,
                 **sections) -> ProbedTrainerGroup:
    """A ProbedTrainerGroup of max(tp, ep) ranks on `model_dir` at TP `tp` (sequence parallel when
    TP > 1) and EP `ep`, 20 scheduled steps; `sections`: TrainerConfig.from_sections' other keywords."""
    parallel = {"tensor_parallel": tp, "expert_parallel": ep, "sequence_parallel": tp > 1}
    config = TrainerConfig.from_sections(str(model_dir), parallel=parallel, peft=peft, optim=optim, seed=seed,
                                         max_num_steps=20, **sections)
    return ProbedTrainerGroup(config, num_ranks=max(tp, ep))
