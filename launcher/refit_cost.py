"""What a refit moves per step, per refit mode, and how long that takes on the topology's link.

Printed by the dry run of a GPU topology after the memory plan (`python -m launcher
topology=ultra_6n4g dry_run=true`), so that a user choosing `refit.mode` sees the cost of each:

  merged         every weight of the model in the trainers' dtype (model.dtype): what
                 `export_merged()` yields, all of it, every step
  merged_delta,  the LoRA factors (A once per fused Megatron linear, one B per HF module:
  adapter        workers.refit.wire), in float32: the trainers gather them as float32
                 (workers.trainer.gather), whatever the model's dtype

and the seconds those bytes take at `topology.interconnect_gb_s`, the bandwidth from trainer rank
0 to the vLLM workers (the broadcast group's source sends every byte once; NCCL pipelines it to
the workers). That is the transfer alone: the export (and the merge), and vLLM's reload of the
weights, come on top. For scale, the upstream Ultra LoRA run (the reference recipe on 6 GB200
nodes, NeMo RL) measured 9.9 s per merged refit for all three together (`SEED_ULTRA_MERGED_S`).
The model's numbers are the memory plan's (`launcher.memory.model_size`); LoRA factors are
counted as the memory plan counts them (exact for attention, an estimate for other targets).
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config.schema import REFIT_MODES, Config
from launcher.memory import DTYPE_BYTES, ModelSize, _lora_parameters, model_size

LORA_WIRE_BYTES = 4          # the LoRA modes send float32 factors (workers.trainer.gather.full_named)
# the upstream Ultra LoRA run (NeMo RL PR #2754's description: 6 GB200 nodes, Nemotron 3 Ultra in bf16, merged
# refit) logged `prepare_for_generation/transfer_and_update_weights end elapsed=9.9008s`
SEED_ULTRA_MERGED_S = 9.9


@dataclass(frozen=True)
class RefitCost:
    mode: str
    bytes: int
    seconds: float      # bytes at topology.interconnect_gb_s


def refit_costs(cfg: Config, size: ModelSize) -> list[RefitCost]:
    """One RefitCost per refit mode this run could use (the LoRA modes only with LoRA)."""
    link = float(cfg.topology.interconnect_gb_s) * 1e9
    payload = {"merged": size.parameters * DTYPE_BYTES.get(cfg.model.dtype, 4)}
    if cfg.peft.enabled:
        lora = _lora_parameters(cfg, size) * LORA_WIRE_BYTES
        payload.update(merged_delta=lora, adapter=lora)
    return [RefitCost(mode, int(payload[mode]), payload[mode] / link) for mode in REFIT_MODES if mode in payload]


def describe(cfg: Config) -> str:
    """The dry run's lines (none on cpu; one note when the model's size is unknown)."""
    if cfg.topology.device != "cuda":
        return ""
    size = model_size(cfg)
    if size is None:
        return "refit per step: no estimate (the model's size is unknown: see the memory plan's note)"
    out = [f"\nrefit per step at {cfg.topology.interconnect_gb_s:g} GB/s from trainer rank 0 to the vLLM workers "
           f"(topology.interconnect_gb_s; the transfer alone, without the export and vLLM's reload):"]
    for c in refit_costs(cfg, size):
        mark = "  <- refit.mode" if c.mode == cfg.refit.mode else ""
        out.append(f"  {c.mode:<13} {_size(c.bytes):>10}  {_seconds(c.seconds):>9}{mark}")
    if not cfg.peft.enabled:
        out.append("  (merged_delta and adapter send LoRA factors: peft.enabled is false)")
    out.append(f"  measured upstream: {SEED_ULTRA_MERGED_S:g} s per merged refit of Nemotron 3 Ultra on 6 GB200 nodes "
               f"(export, transfer and reload together; NeMo RL's Ultra LoRA run)")
    return "\n".join(out)


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 0.01 else f"{s * 1e3:.3g} ms"
