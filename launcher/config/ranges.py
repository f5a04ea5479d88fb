"""The walker: every field's own check (declared on the field in launcher.config.schema, see
launcher.config.fields), then the rules below that tie two or three fields of the config together
and need nothing else (no files, no topology arithmetic: launcher.config.validate and
launcher.plan hold those).

`check(cfg)` runs at submission (validate runs it first, so its rules may assume every field in
range) and on every saved config.yaml read back (launcher.records.load_config). Every float must
also be finite. tests/unit/test_schema_ranges.py walks the schema: a field without a check or a
doc, or a bad value that is accepted, fails it.
"""

from __future__ import annotations

from launcher import metric_names as names
from launcher.config.schema import Config, ConfigError, field_errors


def check(cfg: Config) -> list[ConfigError]:
    """Every field's own check, every float finite, then the cross-field rules."""
    errs = field_errors(cfg)
    return errs or _cross(cfg)  # the cross-field rules assume each field in range


def _cross(cfg: Config) -> list[ConfigError]:
    errs = []
    rs = cfg.grpo.reward_scaling
    if rs.enabled and rs.source_max <= rs.source_min:
        errs.append(ConfigError("grpo.reward_scaling.source_max", f"must exceed source_min = {rs.source_min}, "
                                                                  f"got {rs.source_max}"))
    if rs.enabled and rs.target_max <= rs.target_min:
        errs.append(ConfigError("grpo.reward_scaling.target_max", f"must exceed target_min = {rs.target_min}, "
                                                                  f"got {rs.target_max}"))
    r = cfg.ray
    if r.min_worker_port >= r.max_worker_port:
        errs.append(ConfigError("ray.max_worker_port", f"must exceed ray.min_worker_port = {r.min_worker_port}, "
                                                       f"got {r.max_worker_port}"))
    fixed = {"ray.port": r.port, "ray.node_manager_port": r.node_manager_port,
             "ray.object_manager_port": r.object_manager_port}
    seen: dict[int, str] = {}
    for key, port in fixed.items():
        if port in seen:
            errs.append(ConfigError(key, f"is {port}, the same port as {seen[port]}"))
        elif r.min_worker_port <= port <= r.max_worker_port:
            errs.append(ConfigError(key, f"is {port}, inside the worker port range [{r.min_worker_port}, "
                                         f"{r.max_worker_port}]"))
        seen[port] = key
    if cfg.optim.min_lr > cfg.optim.lr:
        errs.append(ConfigError("optim.min_lr", f"must be at most optim.lr = {cfg.optim.lr}, got {cfg.optim.min_lr}"))
    if cfg.grpo.loss.reference_policy_kl_penalty > 0 and not cfg.peft.enabled:
        errs.append(ConfigError("grpo.loss.reference_policy_kl_penalty",
                                "needs peft.enabled=true (the reference policy is the base model with the LoRA "
                                "adapters switched off); set it to 0 for full fine-tuning"))
    if cfg.checkpointing.metric_name.startswith(names.VAL) and not (cfg.grpo.val_period or cfg.grpo.val_at_start):
        errs.append(ConfigError("checkpointing.metric_name", f"{cfg.checkpointing.metric_name} is only logged with "
                                                             f"validation on (grpo.val_period > 0)"))
    if cfg.grpo.pipeline.enabled and cfg.grpo.loss.truncated_importance_sampling_ratio is None:
        errs.append(ConfigError("grpo.pipeline.enabled", "needs grpo.loss.truncated_importance_sampling_ratio (e.g. "
                                                         "5.0): the truncated importance weight corrects for samples "
                                                         "generated with older weights"))
    if cfg.vllm.max_model_len < cfg.grpo.max_total_sequence_length:
        errs.append(ConfigError("vllm.max_model_len", f"must be at least grpo.max_total_sequence_length = "
                                                      f"{cfg.grpo.max_total_sequence_length}, got {cfg.vllm.max_model_len}"))
    return errs
