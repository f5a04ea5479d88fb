"""launcher/config/bounded.py, the one reader of files from outside the run: each limit refuses in one
line naming the file, and what this launcher writes itself passes (a saved config.yaml, a record,
a real safetensors file, a real sentencepiece model). The public paths (a model folder, a checkpoint,
the exporter) are in tests/unit/test_hostile_inputs.py and tests/unit/test_export_errors.py."""

from __future__ import annotations

import json

import pytest

from launcher.config import bounded


def test_a_file_over_its_limit_is_refused_before_it_is_read(tmp_path):
    f = tmp_path / "big.json"
    f.write_text("[" + "0," * 100 + "0]")
    assert bounded.json_file(f, limit=1000) == [0] * 101
    with pytest.raises(bounded.FileError) as e:
        bounded.json_file(f, limit=100, kind="record")
    assert str(e.value) == f"{f}: 203 bytes, more than the 100 read from a record"


@pytest.mark.parametrize("text,message", [
    ("[" * 70 + "]" * 70, "nested more than 64 levels deep"),
    ("[" * 100000 + "]" * 100000, "nested more than 64 levels deep"),
    ('{"a": NaN}', "not valid JSON (NaN is not JSON)"),
    ('{"a": 1', "not valid JSON (Expecting ',' delimiter: line 1 column 8 (char 7))"),
])
def test_json_limits(tmp_path, text, message):
    f = tmp_path / "x.json"
    f.write_text(text)
    with pytest.raises(bounded.FileError) as e:
        bounded.json_file(f)
    assert str(e.value) == f"{f}: {message}"


def test_a_model_folders_json_reads_infinity_as_transformers_does_and_records_do_not(tmp_path):
    """Python's json (transformers 4, every published Nemotron-H) writes the literal; transformers 5
    writes {"__float__": ...}: both read as the float. The project's own records stay strict."""
    import math

    import transformers

    literal, tagged = tmp_path / "literal.json", tmp_path / "tagged.json"
    literal.write_text(json.dumps({"time_step_limit": [0.0, math.inf], "x": -math.inf, "n": math.nan}))
    tagged.write_text(json.dumps(transformers.PreTrainedConfig._encode_special_floats(
        {"time_step_limit": [0.0, math.inf], "x": -math.inf, "n": math.nan, "kept": {"__float__": "1.5"}})))
    assert "Infinity]" in literal.read_text() and '"__float__": "Infinity"' in tagged.read_text()
    for f in (literal, tagged):
        got = bounded.model_json(f, "model config", obj=True)
        assert got["time_step_limit"] == [0.0, math.inf] and got["x"] == -math.inf and math.isnan(got["n"])
        with pytest.raises(bounded.FileError, match="is not JSON") if f is literal else _no_error():
            bounded.json_file(f)  # a record: the literal is refused (the tag is an ordinary object there)
    assert bounded.model_json(tagged)["kept"] == {"__float__": "1.5"}  # not one of the three: kept, as transformers
    with pytest.raises(bounded.FileError, match="nested more than 64 levels deep"):
        bounded.parse_json("[" * 70 + "Infinity" + "]" * 70, "x", special=True)


def _no_error():
    from contextlib import nullcontext

    return nullcontext()


def test_yaml_without_aliases_and_within_its_budget(tmp_path):
    from launcher.config.compose import compose, to_yaml

    saved = to_yaml(compose(["topology=slurm_3n", "slurm.setup=['export A=1', 'module load x']"]))
    assert "*" not in saved.replace("'*", "") and bounded.parse_yaml(saved, "c.yaml")["run"]["name"]
    with pytest.raises(bounded.FileError, match=r"^c.yaml: an alias \(\*a\) at line 2: aliases are not read"):
        bounded.parse_yaml("a: &a [1, 2]\nb: *a\n", "c.yaml")
    with pytest.raises(bounded.FileError, match=r"an alias \(\*a\) at line 3"):
        bounded.parse_yaml("a: &a {x: 1}\nb:\n  <<: *a\n", "c.yaml")
    with pytest.raises(bounded.FileError, match="more than 1,000 YAML nodes"):
        bounded.parse_yaml("[" + ", ".join(["1"] * 2000) + "]", "c.yaml", nodes=1000)
    with pytest.raises(bounded.FileError, match="nested more than 64 levels deep"):
        bounded.parse_yaml("[" * 100 + "]" * 100, "c.yaml")
    with pytest.raises(bounded.FileError, match="could not determine a constructor for the tag"):
        bounded.parse_yaml("a: !!python/object/apply:os.system ['true']\n", "c.yaml")


def test_a_real_safetensors_header_reads_and_a_cut_one_is_named(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    f = tmp_path / "w.safetensors"
    save_file({"a": np.zeros((3, 5), np.float32), "b": np.ones(7, np.int8)}, str(f), metadata={"format": "pt"})
    h = bounded.safetensors_header(f)
    assert {k: (t.dtype, t.shape) for k, t in h.tensors.items()} == {"a": ("F32", (3, 5)), "b": ("I8", (7,))}
    assert h.metadata == {"format": "pt"} and h.data_end == f.stat().st_size
    f.write_bytes(f.read_bytes()[:-3])
    with pytest.raises(bounded.FileError, match=r"bytes, its tensors end at byte \d+ \(cut short"):
        bounded.safetensors_header(f)


def test_a_real_sentencepiece_model_is_a_whole_protobuf_message_and_its_halves_are_not(tmp_path):
    import sentencepiece as spm

    (tmp_path / "c.txt").write_text("say numbers between ten and forty .\n" * 50)
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "t"), vocab_size=20,
                                   minloglevel=2)
    data = (tmp_path / "t.model").read_bytes()
    bounded.protobuf_message(data, "t.model")
    cut = [n for n in range(1, len(data), max(1, len(data) // 50))]
    refused = 0
    for n in cut:
        try:
            bounded.protobuf_message(data[:n], "t.model")
        except bounded.FileError:
            refused += 1
    assert refused >= len(cut) - 2   # only a cut exactly between two top-level fields reads as whole


def test_a_jsonl_being_appended_to_gives_its_whole_objects(tmp_path):
    f = tmp_path / "metrics.jsonl"
    assert bounded.jsonl_objects(f) == []
    f.write_text('{"step": 1}\n' + "[" * 5000 + "]" * 5000 + '\n[1, 2]\n{"step": NaN}\n\n{"step": 2}\n{"step": 3, "x"')
    assert bounded.jsonl_objects(f) == [{"step": 1}, {"step": 2}]
    with pytest.raises(bounded.FileError, match="more than the 10 read from a log"):
        bounded.jsonl_objects(f, limit=10)


def test_status_reads_a_run_directorys_records_with_limits(sandbox, capsys):
    """`launcher.status` on a run directory someone else can write (a shared filesystem): a metrics line
    nested past any limit or that is not an object is skipped, not a traceback."""
    from launcher import __main__ as cli
    from launcher import status

    assert cli.main(["topology=slurm_3n", "submit=false", f"run.root={sandbox / 'runs'}", "run.name=s"]) == 0
    run = sandbox / "runs" / "s"
    (run / "metrics.jsonl").write_text('{"step": 1, "train/reward": 0.25}\n' + "[" * 5000 + "]" * 5000 + "\n[3]\n")
    capsys.readouterr()
    assert status.main([str(run), "--json"]) == 0, capsys.readouterr().err
    (info,) = json.loads(capsys.readouterr().out)
    assert info["step"] == 1


# ------------------------------------------------------------------ only regular files are read
def _special(tmp_path, kind: str):
    import os
    import socket

    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)          # no writer: a plain open() would block forever
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        return path, s
    elif kind == "directory":
        path.mkdir()
    elif kind == "device":
        path.symlink_to("/dev/zero")  # endless: a read without a size would never end
    elif kind == "dangling":
        path.symlink_to(tmp_path / "gone.json")
    return path, None


@pytest.mark.parametrize("kind,what", [("fifo", "a FIFO"), ("socket", "a socket"), ("directory", "a directory"),
                                       ("device", "a character device")])
@pytest.mark.parametrize("reader", ["json_file", "read_text", "safetensors_header", "model_json"])
def test_only_a_regular_file_is_opened_and_nothing_blocks(tmp_path, kind, what, reader):
    """A FIFO, socket, device or directory where a file is expected (e.g. inside a checkpoint or a
    model folder) is one line naming it, at once: opening a FIFO that has no writer never blocks."""
    path, keep = _special(tmp_path, kind)
    call = {"json_file": lambda: bounded.json_file(path), "read_text": lambda: bounded.read_text(path, 100),
            "safetensors_header": lambda: bounded.safetensors_header(path),
            "model_json": lambda: bounded.model_json(path)}[reader]
    try:
        with pytest.raises(bounded.FileError) as e:
            call()
        assert str(e.value) == f"{path}: {what}, not a regular file: only files are read"
        assert not isinstance(e.value, bounded.FileMissing)
    finally:
        if keep is not None:
            keep.close()


def test_a_dangling_link_is_a_missing_file_and_a_link_to_a_file_is_read(tmp_path):
    path, _ = _special(tmp_path, "dangling")
    with pytest.raises(bounded.FileMissing, match="unreadable \\(No such file or directory\\)"):
        bounded.json_file(path)
    (tmp_path / "gone.json").write_text('{"a": 1}')
    assert bounded.json_file(path) == {"a": 1}
