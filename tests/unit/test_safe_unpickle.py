"""Checkpoints from others do not run code: workers/safe_unpickle.py and the checks in
launcher/driver/checkpoints.verify, on real torch distributed checkpoints (the format megatron's
torch_dist writes). The forged pickle writes a marker file when unpickled: the marker must not
appear, via the exporter's CLI and via the resume check a submission runs."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from launcher.config.schema import Checkpointing
from launcher.driver.checkpoints import MANIFEST, CheckpointError, CheckpointManager, _files, verify
from workers import safe_unpickle


class Payload:
    """What an attacker pickles: unpickling it calls os.system (here: touch a marker)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def real_dcp(directory: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight": torch.randn(2, 8, 128),
             "optimizer.state.step": torch.tensor(3.0), "half": torch.zeros(4, dtype=torch.bfloat16),
             "common_state": io.BytesIO(pickle.dumps({"trainer": {"step": 3}}))}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)


def forge(metadata: Path, marker: Path) -> None:
    """Replace `.metadata` with a pickle that runs code, keeping a real Metadata inside it."""
    with open(metadata, "rb") as f:
        real = pickle.load(f)
    metadata.write_bytes(pickle.dumps((Payload(marker), real)))


def rewrite_manifest(ckpt: Path) -> None:
    """What anyone who can write the folder can do: a manifest that matches the forged files."""
    (ckpt / MANIFEST).write_text(json.dumps({"files": _files(ckpt)}))


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    from launcher.config import compose as config_mod

    manager = CheckpointManager(tmp_path / "run" / "checkpoints", Checkpointing())
    tmp = manager.begin(3)
    real_dcp(tmp / "trainer")
    raw = config_mod.compose(["run.name=run", "peft.dim=8", "peft.alpha=16"])
    return manager.commit(tmp, 3, {"consumed_prompts": 0, "metrics": {}}, config_mod.to_yaml(raw)).path


def test_real_metadata_loads_the_same_as_pickle(checkpoint):
    meta = checkpoint / "trainer" / ".metadata"
    with open(meta, "rb") as f:
        expected = pickle.load(f)
    with open(meta, "rb") as f:
        got = safe_unpickle.load(f)
    assert got == expected
    verify(checkpoint)  # a real checkpoint passes


def test_forged_metadata_with_a_valid_manifest_is_refused_and_runs_nothing(checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    forge(checkpoint / "trainer" / ".metadata", marker)
    rewrite_manifest(checkpoint)
    with pytest.raises(CheckpointError) as e:
        verify(checkpoint)
    assert str(e.value) == (f"{checkpoint / 'trainer' / '.metadata'}: refused to unpickle posix.system (not a "
                            f"checkpoint metadata class); the checkpoint was not written by this launcher, nothing "
                            f"was run")
    assert not marker.exists()


def test_installed_reader_refuses_the_forged_pickle(checkpoint, tmp_path):
    """The seam the trainers and the exporter read through: FileSystemReader.read_metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    safe_unpickle.install()
    assert FileSystemReader(str(checkpoint / "trainer")).read_metadata().state_dict_metadata
    marker = tmp_path / "pwned"
    forge(checkpoint / "trainer" / ".metadata", marker)
    with pytest.raises(safe_unpickle.Refused, match="posix.system"):
        FileSystemReader(str(checkpoint / "trainer")).read_metadata()
    assert not marker.exists()


def test_export_of_a_forged_checkpoint_runs_nothing(checkpoint, tmp_path, capsys):
    from launcher.export import main

    marker = tmp_path / "pwned"
    forge(checkpoint / "trainer" / ".metadata", marker)
    rewrite_manifest(checkpoint)
    rc = main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "refused to unpickle posix.system" in err and err.count("\n") == 1, err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_resume_of_a_forged_checkpoint_runs_nothing(checkpoint, tmp_path, capsys, monkeypatch):
    from launcher import __main__ as cli

    marker = tmp_path / "pwned"
    forge(checkpoint / "trainer" / ".metadata", marker)
    rewrite_manifest(checkpoint)
    monkeypatch.setattr(cli, "_run_here", lambda *a, **k: 99)
    rc = cli.main([f"run.root={tmp_path / 'other'}", "peft.dim=8", "peft.alpha=16", f"+resume={checkpoint}"])
    err = capsys.readouterr().err
    assert rc == 2 and "refused to unpickle posix.system" in err and err.count("\n") == 1, err
    assert not marker.exists()


@pytest.mark.parametrize("entry", ["../../outside.txt", "/etc/hostname", "trainer/../../x"])
def test_manifest_entry_outside_the_checkpoint_is_an_error(checkpoint, entry):
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][entry] = {"size": 1, "sha256": "0" * 64}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"entry '{entry}' points outside the checkpoint"):
        verify(checkpoint)


def test_symlink_out_of_the_checkpoint_is_an_error(checkpoint, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("x")
    (checkpoint / "trainer" / "link").symlink_to(secret)
    rewrite_manifest(checkpoint)
    with pytest.raises(CheckpointError, match="'trainer/link' points outside the checkpoint"):
        verify(checkpoint)


def test_infinite_step_is_one_clear_error(checkpoint):
    (checkpoint / "training_info.json").write_text('{"step": Infinity, "consumed_prompts": 0}')
    rewrite_manifest(checkpoint)
    with pytest.raises(CheckpointError, match="not valid training info"):
        verify(checkpoint)


@pytest.mark.parametrize("config,message", [
    ("[1, 2]", "config.json must hold a JSON object, got list"),
    ('{"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2}', "num_attention_heads is missing"),
    ('{"model_type": "llama", "hidden_size": "big", "num_attention_heads": 4, "num_hidden_layers": 2}',
     "hidden_size must be a positive integer, got 'big'"),
])
def test_export_base_model_with_an_odd_config_is_one_line(checkpoint, tmp_path, capsys, config, message):
    from launcher.export import main

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(config)
    rc = main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"), "--base-model", str(base)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "(the base model, from --base-model)" in err and err.count("\n") == 1, err


def test_the_lora_scan_reads_through_the_restricted_unpickler(checkpoint, tmp_path):
    """workers/lora/checkpoint.scan (the exporter's reader), even without the driver's verify."""
    from workers.lora.checkpoint import LoraCheckpointError, scan

    assert scan(checkpoint / "trainer").lora
    marker = tmp_path / "pwned"
    forge(checkpoint / "trainer" / ".metadata", marker)
    with pytest.raises(LoraCheckpointError, match="refused to unpickle posix.system"):
        scan(checkpoint / "trainer")
    assert not marker.exists()
