"""Config composition and validation: each bad config gets exactly one clear line (exit code 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.__main__ import main
from launcher.config.compose import compose
from launcher.config.schema import ConfigError, typed
from launcher.config.validate import validate

REPO_PYTHON = sys.executable


def errors_of(*overrides: str) -> list[str]:
    try:
        cfg = typed(compose(list(overrides)))
    except ConfigError as e:
        return [str(e)]
    return [str(e) for e in validate(cfg)]


@pytest.mark.parametrize("overrides", [
    [], ["topology=ultra_6n4g"], ["topology=slurm_2n"], ["topology=slurm_3n"], ["topology=slurm_4n"],
    ["peft=lora_all_linear", "refit=merged_delta"], ["refit=adapter"], ["peft=none"], ["model=tiny_qwen2"],
    ["+resume=step_5"],
])
def test_shipped_configs_are_valid(overrides):
    assert errors_of(*overrides) == []


BAD = [
    (["topology=foo"],
     "topology: no option 'foo'; available: local, slurm_2n, slurm_3n, slurm_4n, ultra_6n4g"),
    (["topolgy.nodes=2"], "topolgy.nodes: unknown key (check the spelling, or use +key=value to add a new key)"),
    (["+dry_run=true"], "dry_run: already exists: drop the leading '+' to change it"),
    (["grpo.max_num_steps=abc"], "grpo.max_num_steps: expected an integer, got 'abc'"),
    (["peft.target_modules=linear_qkv"], "peft.target_modules: expected a list like [a, b], got 'linear_qkv'"),
    (["topology=slurm_3n", "topology.nodes=4"],
     "topology.nodes: must equal train.nodes + generation.nodes = 2 + 1 = 3, got 4"),
    (["topology=slurm_3n", "topology.train.tensor_parallel=3"],
     ["topology.train.tensor_parallel: TP x PP x CP = 3 x 1 x 1 = 3 must divide the 2 trainer ranks "
      "(train.nodes x ranks_per_node); allowed TP: 1, 2",
      "topology.train.tensor_parallel: must divide model.num_query_groups = 2 (a TP rank holds whole query "
      "groups), got 3"]),
    (["topology=ultra_6n4g", "topology.train.tensor_parallel=16"],
     ["topology.train.tensor_parallel: must divide model.num_query_groups = 2 (a TP rank holds whole query groups), "
      "got 16",
      "topology.train.tensor_parallel: must divide the Mamba heads (256) and groups (8) of model nemotron-3-ultra, "
      "got 16"]),
    (["topology=ultra_6n4g", "topology.train.expert_parallel=32"],
     "topology.train.expert_parallel: EP x ETP x PP = 32 must divide the 16 trainer ranks; "
     "allowed EP: 1, 2, 4, 8, 16"),
    (["topology=ultra_6n4g", "topology.train.ranks_per_node=8"],
     "topology.train.ranks_per_node: one rank per GPU: at most gpus_per_node = 4, got 8"),
    (["topology=ultra_6n4g", "topology.generation.tensor_parallel=4"],
     "topology.generation.tensor_parallel: engines x TP = 1 x 4 must equal the 8 vLLM workers "
     "(generation.nodes x ranks_per_node)"),
    (["topology=ultra_6n4g", "topology.generation.tensor_parallel=6", "topology.generation.engines=1",
      "topology.generation.ranks_per_node=3"],
     "topology.generation.tensor_parallel: must divide model.num_attention_heads = 64 (vLLM splits heads), got 6"),
    (["topology.generation.tensor_parallel=2", "topology.generation.ranks_per_node=2"],
     "topology.generation.tensor_parallel: vLLM on CPU runs in-process: must be 1"),
    (["topology.nodes=2"], "topology.nodes: the local executor runs on this machine: nodes must be 1, got 2"),
    (["topology.train.expert_parallel=2"],
     "topology.train.expert_parallel: model tiny_llama has no experts: must be 1, got 2"),
    (["topology.train.sequence_parallel=true", "topology.train.tensor_parallel=1"],
     "topology.train.sequence_parallel: needs train.tensor_parallel > 1"),
    (["peft.target_modules=[linear_qkvv]"],
     "peft.target_modules: 'linear_qkvv' matches no module of model tiny_llama (llama); allowed: linear_fc1, "
     "linear_fc2, linear_proj, linear_qkv or a pattern like decoder.layers.*.self_attention.linear_qkv"),
    (["peft.target_modules=[decoder.layers.*.mixer.in_proj]"],
     "peft.target_modules: 'decoder.layers.*.mixer.in_proj' matches no module of model tiny_llama (llama); "
     "allowed: linear_fc1, linear_fc2, linear_proj, linear_qkv or a pattern like "
     "decoder.layers.*.self_attention.linear_qkv"),
    (["peft.dim=0"], "peft.dim: LoRA rank must be at least 1, got 0"),
    (["peft.dropout_position=middle"], "peft.dropout_position: must be pre or post, got 'middle'"),
    (["refit=adapter", "vllm.max_lora_rank=12"],
     "vllm.max_lora_rank: vLLM allows 1, 8, 16, 32, 64, 128, 256, 320, 512; got 12"),
    (["refit=adapter", "peft.dim=32"],
     "vllm.max_lora_rank: must be at least peft.dim = 32 for refit.mode=adapter, got 16"),
    (["refit=merged_delta", "peft=none"],
     "refit.mode: merged_delta sends LoRA factors: needs peft.enabled=true (full fine-tuning uses refit=merged)"),
    (["refit.transport=nccl"], "refit.transport: nccl needs topology.device=cuda; on cpu use auto, ray or gloo"),
    (["model.path=/nonexistent/model"], None),  # only checked when submitting (see below)
    (["grpo.num_prompts_per_step=5", "grpo.num_generations_per_prompt=3", "topology=slurm_3n",
      "topology.train.tensor_parallel=1"],
     "grpo.num_prompts_per_step: prompts x generations = 15 must divide evenly over the 2 data-parallel trainer "
     "groups"),
    (["grpo.max_total_sequence_length=8"],
     "grpo.max_total_sequence_length: must exceed grpo.max_new_tokens = 8 (prompt + response), got 8"),
    (["checkpointing.save_period=0"], "checkpointing.save_period: must be at least 1, got 0"),
    (["slurm.time_min=1", "slurm.signal_delay_s=90"],
     "slurm.signal_delay_s: must be in [0, time_min*60) = [0, 60), got 90"),
    (["run.job=train"], "run.job: must be one of grpo, placement_smoke, hold, preflight, got 'train'"),
    # the sections Hydra takes from the schema (SCHEMA_SECTIONS): the same words as every other key
    (["vllm.max_lora_rank=abc"], "vllm.max_lora_rank: expected an integer, got 'abc'"),
    (["logging.tensorboard=maybe"], "logging.tensorboard: expected true or false, got 'maybe'"),
    (["ray.prot=1"], "ray.prot: unknown key (check the spelling, or use +key=value to add a new key)"),
    (["+retry.max_restart=1"], "retry.max_restart: unknown key (check the spelling)"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_gets_exactly_this_message(overrides, message):
    errs = errors_of(*overrides)
    if message is None:
        assert errs == []
    else:
        assert errs == (message if isinstance(message, list) else [message])


def test_missing_model_path_is_an_error_when_submitting(capsys, tmp_path):
    rc = main(["model.path=/nonexistent/model", f"run.root={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == "error: model.path: /nonexistent/model is not a directory (a local HF checkpoint is needed)\n"
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_model_facts_come_from_config_json(tiny_model, capsys, tmp_path):
    """The checkpoint is the source of its architecture: a conf number that disagrees is a note."""
    path = tiny_model("tiny_llama")
    capsys.readouterr()
    rc = main([f"model.path={path}", "model.num_query_groups=4", f"run.root={tmp_path}", "dry_run=true"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert err == (f"note: model: {path}/config.json says num_query_groups=2 (conf: 4); "
                   f"using the checkpoint's numbers\n")
    assert "  num_query_groups: 2\n" in out  # the resolved config holds the checkpoint's number


def test_values_that_would_break_the_script_are_rejected():
    from launcher import plan as plan_mod
    from launcher.job import sbatch

    for field, value, what in [("partition", "gpu\nrm -rf /", "contains a newline; a value must be a single line"),
                               ("account", "lab'", "has an unbalanced quote: \"lab'\"")]:
        cfg = typed(compose(["topology=slurm_3n"]))
        setattr(cfg.slurm, field, value)
        with pytest.raises(ConfigError) as e:
            sbatch.job_spec(cfg, plan_mod.build(cfg.topology))
        assert str(e.value) == f"slurm.{field}: {what}"
    cfg = typed(compose(["topology=slurm_3n", "slurm.setup=[module load cuda, 'echo \"x']"]))
    with pytest.raises(ConfigError) as e:
        sbatch.job_spec(cfg, plan_mod.build(cfg.topology))
    assert str(e.value) == "slurm.setup[1]: has an unbalanced quote: 'echo \"x'"


def test_quoted_values_are_quoted_in_the_script(tmp_path, capsys):
    rc = main(["topology=slurm_3n", "slurm.partition='gpu a;b'", f"run.root={tmp_path}", "dry_run=true"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "#SBATCH --partition='gpu a;b'" in out


def test_unparsable_override_is_named(capsys, tmp_path):
    assert main(["topology=slurm_3n", "slurm.partition=gpu'", f"run.root={tmp_path}"]) == 2
    assert capsys.readouterr().err == ("error: slurm.partition=gpu': cannot parse this override (expected key=value; "
                                       "quote values with special characters: key='a b')\n")


def test_cli_errors_are_one_line_without_traceback(tmp_path):
    p = subprocess.run([REPO_PYTHON, "-m", "launcher", "topology=slurm_3n", "topology.nodes=5",
                        f"run.root={tmp_path}"], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr == "error: topology.nodes: must equal train.nodes + generation.nodes = 2 + 1 = 3, got 5\n"


def test_unknown_flag_and_help():
    p = subprocess.run([REPO_PYTHON, "-m", "launcher", "--nodes=3"], capture_output=True, text=True)
    assert (p.returncode, p.stderr) == (2, "error: --nodes=3: not an option; arguments are key=value overrides "
                                           "(see --help)\n")
    h = subprocess.run([REPO_PYTHON, "-m", "launcher", "--help"], capture_output=True, text=True)
    assert h.returncode == 0
    assert "topology       local, slurm_2n, slurm_3n, slurm_4n, ultra_6n4g" in h.stdout
    assert "+resume=step_N|latest|PATH" in h.stdout


def test_fresh_run_over_existing_checkpoints_is_refused(tmp_path, capsys):
    run = tmp_path / "local-tiny_llama"
    (run / "checkpoints" / "step_5").mkdir(parents=True)
    (run / "keep.txt").write_text("mine")
    rc = main([f"run.root={tmp_path}"])
    assert rc == 2
    assert capsys.readouterr().err == (
        f"error: run.name: {run} already holds checkpoints (step_5); continue it with +resume=latest, "
        f"or start fresh with run.name=<new name>\n")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "keep.txt"]


def test_schema_sections_have_their_defaults_in_one_place():
    """conf/config.yaml holds no value of a SCHEMA_SECTIONS section but interpolations; the composed
    (and so the saved) config has every key of the schema's section, at the schema's default."""
    import dataclasses

    from omegaconf import OmegaConf

    from launcher.config.compose import CONF_DIR
    from launcher.config.schema import SCHEMA_SECTIONS

    raw = OmegaConf.load(CONF_DIR / "config.yaml")
    composed = compose([])
    for name, cls in SCHEMA_SECTIONS.items():
        in_yaml = raw.get(name) or {}
        for key in in_yaml:
            assert OmegaConf.is_interpolation(in_yaml, key), f"conf/config.yaml repeats {name}.{key}"
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        assert list(composed[name]) == list(defaults), name
        for key, value in defaults.items():
            if key not in in_yaml:
                assert composed[name][key] == value, f"{name}.{key}"
