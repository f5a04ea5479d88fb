"""launcher.logs: the launcher's lines through `logging`, as they always read.

`[launcher HH:MM:SS] message` on stdout (the driver's log of a Slurm job is task 0's stdout), a
PLAIN line alone, one copy even when a library configured the root logger (megatron does at
import), and the commands' -q / -v.
"""

from __future__ import annotations

import logging
import re

import pytest

from launcher import cli, logs
from launcher.cluster import context, stop
from launcher.driver import jobs

LINE = re.compile(r"^\[launcher \d\d:\d\d:\d\d\] (.*)$")


@pytest.fixture(autouse=True)
def default_level():
    yield
    logs.setup(0)


def test_every_package_logs_the_one_line_format_on_stdout(capsys):
    context.log("Ray head up")                     # launcher.cluster
    jobs.log("placement smoke: 3 actors")          # launcher.driver
    stop.request_stop("nothing runs")              # no driver: says nothing
    logs.get("launcher.driver.metrics").info("[####] step 1/2", extra=logs.PLAIN)
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [LINE.match(x).group(1) for x in lines[:2]] == ["Ray head up", "placement smoke: 3 actors"]
    assert lines[2:] == ["[####] step 1/2"] and err == ""
    assert logs.get("launcher.driver.grpo").name == "launcher.driver"
    assert logs.get("launcher.__main__").name == logs.get("launcher.status").name == "launcher"


def test_a_root_handler_does_not_double_the_lines(capsys):
    root = logging.getLogger()
    extra = logging.StreamHandler()
    root.addHandler(extra)
    try:
        context.log("once")
    finally:
        root.removeHandler(extra)
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and LINE.match(out.strip()).group(1) == "once" and err == ""


def test_quiet_and_verbose_on_every_commands_parser(capsys):
    p = cli.Parser(prog="demo")
    assert p.parse_args(["-q"]).verbosity == -1
    context.log("progress")
    logs.get("launcher.cluster").warning("why the run stops")
    assert [LINE.match(x).group(1) for x in capsys.readouterr().out.splitlines()] == ["why the run stops"]
    assert p.parse_args(["--verbose"]).verbosity == 1
    logs.get("launcher.job").debug("$ squeue -h -j 1")
    assert capsys.readouterr().out.endswith("] $ squeue -h -j 1\n")
    p.parse_args([])
    logs.get("launcher.job").debug("not shown")
    assert capsys.readouterr().out == ""
    with pytest.raises(cli.UsageError, match="not allowed with"):
        p.parse_args(["-q", "-v"])


def test_verbose_status_shows_the_slurm_commands_it_runs(tmp_path, capsys):
    from launcher import __main__ as launcher_cli
    from launcher import status

    assert launcher_cli.main(["topology=slurm_2n", "submit=false", f"run.root={tmp_path}", "run.name=r"]) == 0
    (tmp_path / "r" / "submissions.jsonl").write_text('{"time": "T", "job_id": "4242", "argv": []}\n')
    capsys.readouterr()
    assert status.main(["-v", "--json", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert LINE.match(out[0]).group(1) == "$ squeue -h -j 4242 -o '%T|%r'"
    assert status.main(["--json", str(tmp_path / "r")]) == 0
    assert not capsys.readouterr().out.startswith("[launcher")
