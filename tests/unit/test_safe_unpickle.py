"""Checkpoints from others do not run code: workers/safe_unpickle.py and the checks in
launcher/driver/checkpoints.verify, on real torch distributed checkpoints (the format megatron's
torch_dist writes). The forged pickle writes a marker file when unpickled: the marker must not
appear, via the exporter's CLI and via the resume check a submission runs."""

from __future__ import annotations

import builtins
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch

from launcher.config.schema import Checkpointing
from launcher.driver.checkpoints import MANIFEST, CheckpointError, CheckpointManager, verify
from workers import safe_unpickle


class Payload:
    """What an attacker pickles: unpickling it calls os.system (here: touch a marker)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def real_dcp(directory: Path) -> None:
    """A torch distributed checkpoint as megatron's torch_dist writes a trainer's: sharded tensors,
    a bfloat16 one, and the common state object (tests/helpers/checkpoints.py)."""
    from tests.helpers.checkpoints import trainer_state

    trainer_state(directory, 3, {"decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight": torch.randn(2, 8, 128),
                                 "optimizer.state.step": torch.tensor(3.0), "half": torch.zeros(4, dtype=torch.bfloat16)})


def forge(metadata: Path, marker: Path) -> None:
    """Replace `.metadata` with a pickle that runs code, keeping a real Metadata inside it."""
    with open(metadata, "rb") as f:
        real = pickle.load(f)
    metadata.write_bytes(pickle.dumps((Payload(marker), real)))


def rewrite_manifest(ckpt: Path) -> None:
    """What anyone who can write the folder can do: a manifest that matches the forged files."""
    from tests.helpers.checkpoints import rewrite_manifest as rewrite

    rewrite(ckpt)


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


def test_a_manifest_entry_with_a_nul_byte_is_one_line(checkpoint):
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"]["trainer/\u0000x"] = {"size": 1, "sha256": "0" * 64}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=re.escape("entry 'trainer/\\x00x' holds a NUL byte, not a file name")):
        verify(checkpoint)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["trainer/pipe", "pipe"])
def test_a_fifo_in_a_checkpoint_is_refused_at_once(checkpoint, where):
    """A FIFO nobody writes to: any open of it for reading would block forever."""
    os.mkfifo(checkpoint / where)
    with pytest.raises(CheckpointError, match=f"{where}: not part of the checkpoint"):
        verify(checkpoint)
    (checkpoint / where).unlink()
    listed = sorted(p for p in (checkpoint / "trainer").iterdir() if p.is_file())[0]  # a listed file's place
    listed.unlink()
    os.mkfifo(listed)
    with pytest.raises(CheckpointError, match="missing"):
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
    with pytest.raises(CheckpointError, match="training_info.json: not valid JSON"):
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


# ----------------------------------------------------------------------------- what is refused
# The allowlist is tested by what it refuses, not by one gadget: each of these pickles calls a
# global that runs code, reads or writes files, imports or reaches other objects. Those marked
# `live` write the marker file when unpickled with plain pickle (checked below, so the gadget is
# real); the restricted unpickler must refuse each, naming the global, before anything runs.
class Call:
    """A pickled call `fn(*args)` (pickle stores `fn` by reference: module and name)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('ran')"


GADGETS = {  # name: (pickled object for a marker path, the global refused first, live)
    "eval": (lambda m: Call(builtins.eval, _code(m)), "builtins.eval", True),
    "exec": (lambda m: Call(builtins.exec, _code(m)), "builtins.exec", True),
    "open": (lambda m: Call(builtins.open, str(m), "w"), "builtins.open", True),
    "compile": (lambda m: Call(builtins.compile, _code(m), "<pickle>", "exec"), "builtins.compile", False),
    "getattr": (lambda m: Call(builtins.getattr, Call(builtins.__import__, "os"), "system"), "builtins.getattr", False),
    "__import__": (lambda m: Call(builtins.__import__, "os"), "builtins.__import__", False),
    "setattr": (lambda m: Call(builtins.setattr, Call(builtins.__import__, "os"), "x", 1), "builtins.setattr", False),
    "vars": (lambda m: Call(builtins.vars), "builtins.vars", False),
    "globals": (lambda m: Call(builtins.globals), "builtins.globals", False),
    "breakpoint": (lambda m: Call(builtins.breakpoint), "builtins.breakpoint", False),
    "os.system": (lambda m: Payload(m), "posix.system", True),
    "subprocess.Popen": (lambda m: Call(__import__("subprocess").Popen, ["touch", str(m)]), "subprocess.Popen", True),
    "importlib.import_module": (lambda m: Call(__import__("importlib").import_module, "os"),
                                "importlib.import_module", False),
    "pickle.loads (nested)": (lambda m: Call(pickle.loads, pickle.dumps(Payload(m))), "_pickle.loads", True),
    "torch.load": (lambda m: Call(torch.load, str(m)), "torch.serialization.load", False),
    "functools.partial": (lambda m: Call(__import__("functools").partial, builtins.exec, _code(m)),
                          "functools.partial", False),
    "operator.methodcaller": (lambda m: Call(__import__("operator").methodcaller, "system", f"touch {m}"),
                              "operator.methodcaller", False),
    "codecs.decode": (lambda m: Call(__import__("codecs").decode, b"x", "hex"), "_codecs.decode", False),
}


def _real_builtins(fn):
    """fn() with builtins.__import__ the interpreter's own: a process that built a model on CPU has
    workers.cpu_shim's import hook there, and pickle would name the hook instead of the builtin."""
    import sys

    shim = sys.modules.get("workers.cpu_shim.megatron")
    hooked, builtins.__import__ = builtins.__import__, getattr(shim, "_ORIGINAL_IMPORT", builtins.__import__)
    try:
        return fn()
    finally:
        builtins.__import__ = hooked


def _pickles(obj) -> dict[str, bytes]:
    """The same object at every protocol: GLOBAL (0-3) and STACK_GLOBAL (4-5) opcodes."""
    return {f"protocol {p}": pickle.dumps(obj, protocol=p) for p in (0, 2, 4, 5)}


@pytest.mark.parametrize("name", list(GADGETS))
def test_the_restricted_unpickler_refuses(name, tmp_path):
    make, refused, _ = GADGETS[name]
    marker = tmp_path / "ran"
    for protocol, data in _real_builtins(lambda: _pickles(make(marker))).items():
        with pytest.raises(safe_unpickle.Refused) as e:
            safe_unpickle.loads(data)
        # protocols 0-2 spell some globals the Python 2 way (fix_imports): __builtin__.eval, io.open
        assert e.value.name == refused or e.value.name.rpartition(".")[2] == refused.rpartition(".")[2], \
            (name, protocol, e.value.name)
        assert str(e.value) == f"refused to unpickle {e.value.name} (not a checkpoint metadata class)"
        assert not marker.exists(), (name, protocol)
    assert safe_unpickle.Refused(*refused.rsplit(".", 1)).name == refused


@pytest.mark.parametrize("name", [n for n, (_, _, live) in GADGETS.items() if live])
def test_each_live_gadget_runs_under_plain_pickle(name, tmp_path):
    """The gadgets are real: plain pickle.loads writes the marker (so the refusal above is what
    keeps it from running, not a gadget that would do nothing)."""
    import time

    make, _, _ = GADGETS[name]
    marker = tmp_path / "ran"
    result = pickle.loads(_real_builtins(lambda: pickle.dumps(make(marker))))
    if hasattr(result, "wait"):  # subprocess.Popen
        result.wait()
    if hasattr(result, "close"):  # open(...)
        result.close()
    deadline = time.time() + 5
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists()


@pytest.mark.parametrize("module,name", [
    ("torch", "__builtins__"), ("torch", "load"), ("torch", "_C"), ("torch", "ops"), ("collections", "namedtuple"),
    ("pathlib", "Path"), ("builtins", "object"), ("builtins", "type"), ("sys", "modules"), ("os", "environ"),
    ("torch.distributed.checkpoint.metadata", "torch"), ("__main__", "Payload"),
])
def test_names_next_to_allowed_ones_are_refused(module, name):
    """An allowed module does not admit its other names (torch admits dtypes and Size only)."""
    data = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."
    with pytest.raises(safe_unpickle.Refused) as e:
        safe_unpickle.loads(data)
    assert e.value.name == f"{module}.{name}"


def test_inst_and_obj_opcodes_go_through_the_same_check(tmp_path):
    """Protocol 0's INST and protocol 1's OBJ build an instance from a class they name: the same
    find_class, the same refusal."""
    marker = tmp_path / "ran"
    inst = b"(S'touch " + str(marker).encode() + b"'\nios\nsystem\n."
    obj = b"(cos\nsystem\nS'touch " + str(marker).encode() + b"'\no."
    for data in (inst, obj):
        with pytest.raises(safe_unpickle.Refused, match="refused to unpickle os.system"):
            safe_unpickle.loads(data)
    assert not marker.exists()


def test_allowed_globals_are_exactly_the_checkpoint_classes():
    """Every name admitted is a class or function of checkpoint metadata: no builtin that runs
    code or reaches other objects is in the list (the table above then cannot pass by luck)."""
    assert safe_unpickle.ALLOWED["builtins"] == frozenset({"set", "frozenset", "slice", "complex"})
    for module, names in safe_unpickle.ALLOWED.items():
        assert not names & {"eval", "exec", "compile", "open", "getattr", "setattr", "__import__", "globals",
                            "vars", "system", "load", "loads", "Popen", "partial", "import_module"}, module


# ------------------------------------------------------------------ the bytes items of a DCP checkpoint


def forge_common_state(trainer: Path, marker: Path) -> None:
    """Rewrite the trainer state's common state (megatron's `common_state` bytes item, what
    load_common_state_dict reads at every resume) as torch.save of an object that runs code."""
    import io
    import shutil

    from tests.helpers.checkpoints import COMMON_STATE_KEY, save_like_megatron

    shutil.rmtree(trainer)
    common = io.BytesIO()
    torch.save([{"trainer": {"step": 3}, "x": Payload(marker)}], common)
    save_like_megatron({COMMON_STATE_KEY: common, "half": torch.zeros(4)}, trainer)


def test_dcps_own_planner_runs_a_forged_common_state(checkpoint, tmp_path):
    """The hole: DCP's DefaultLoadPlanner.load_bytes unpickles bytes items with weights_only=False,
    so megatron's load_common_state_dict (every trainer rank at resume) ran the forged object.
    Shown in a fresh process (this one has the restricted planner installed)."""
    import subprocess
    import sys

    marker = tmp_path / "ran"
    forge_common_state(checkpoint / "trainer", marker)
    code = ("import io, torch.distributed.checkpoint as dcp\n"
            "from torch.distributed.checkpoint import FileSystemReader\n"
            f"box = {{'common_state/shard_0_1': io.BytesIO()}}\n"
            f"dcp.load(box, storage_reader=FileSystemReader({str(checkpoint / 'trainer')!r}), no_dist=True)\n")
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", "from test_safe_unpickle import Payload\n" + code],
                       capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert marker.exists(), p.stderr[-2000:]


def test_a_forged_common_state_is_refused_and_runs_nothing(checkpoint, tmp_path):
    """With safe_unpickle installed (the driver's verify, the trainers, the exporter) bytes items
    are read with torch.load(weights_only=True): refused, naming the global, nothing run."""
    marker = tmp_path / "ran"
    forge_common_state(checkpoint / "trainer", marker)
    rewrite_manifest(checkpoint)
    with pytest.raises(CheckpointError) as e:
        verify(checkpoint)
    assert str(e.value) == (f"{checkpoint / 'trainer'}: refused to unpickle posix.system (in the bytes item "
                            f"common_state/shard_0_1: not plain checkpoint data); the checkpoint was not written by "
                            f"this launcher, nothing was run")
    assert not marker.exists()
