"""Fixtures of the unit tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A fresh directory to run `python -m launcher` in (cli.main): it is the cwd and HOME's parent,
    the umask is a typical login shell's (the launcher sets its own), and nothing is run or submitted
    (the local run returns 99, a submission 98)."""
    from launcher import __main__ as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cli, "_run_here", lambda *a, **k: 99)
    monkeypatch.setattr(cli, "_submit", lambda *a, **k: 98)
    old = os.umask(0o022)
    yield tmp_path
    os.umask(old)
