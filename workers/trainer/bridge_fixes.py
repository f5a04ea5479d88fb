"""Megatron-Bridge 0.6.2 defects the trainer works around, on every device (the CPU-only adaptations
are workers.cpu_shim's). `apply()` is idempotent; workers.trainer.build calls it before a model exists.

  lora_in_proj_merge  The merged export (`export_hf_weights(merge_adapter_weights=True)`, the `merged`
                      refit) gathers every LoRA-B over TP with a plain ColumnParallelMapping: the
                      ranks' rows one after the other. A Mamba in_proj's rows are [z, x, B, C, dt]
                      on each TP rank (megatron shards each part on its own, and the base weight is
                      gathered part by part with MambaInProjMapping), so at TP>1 its B came out in
                      another row order than the base weight it is merged into: the merged in_proj
                      was wrong (measured: logprobs 3.0 off vs the trainer at TP2; right at TP1).
                      The B of an adapter whose base weight maps through MambaInProjMapping is
                      gathered with that mapping too. (Checkpoints were never affected: the bridge
                      saves that B as its five parts; nor merged_delta / adapter refit and the
                      exporter, which gather it themselves, see workers.trainer.gather.)
"""

from __future__ import annotations

APPLIED: list[str] = []


def apply() -> list[str]:
    if "lora_in_proj_merge" not in APPLIED:
        _lora_in_proj_merge()
    return list(APPLIED)


def _lora_in_proj_merge() -> None:
    from dataclasses import replace

    from megatron.bridge.models.conversion.param_mapping import MambaInProjMapping
    from megatron.bridge.models.conversion.peft_bridge import MegatronPeftBridge

    original = MegatronPeftBridge.build_adapter_conversion_tasks

    def build_adapter_conversion_tasks(self, megatron_model, exclude_adapter_base_prefixes=None):
        tasks_by_base = original(self, megatron_model, exclude_adapter_base_prefixes)
        registry = self.mapping_registry()
        for base, tasks in tasks_by_base.items():
            for i, task in enumerate(tasks):
                if not isinstance(registry.megatron_to_hf_lookup(f"{task.global_base_prefix}.weight"),
                                  MambaInProjMapping):
                    continue
                out = task.linear_out_task
                mapping = MambaInProjMapping(megatron_param=out.mapping.megatron_param, hf_param=out.mapping.hf_param)
                tasks[i] = replace(task, linear_out_task=replace(out, mapping=mapping))
        return tasks_by_base

    MegatronPeftBridge.build_adapter_conversion_tasks = build_adapter_conversion_tasks
    APPLIED.append("lora_in_proj_merge")
