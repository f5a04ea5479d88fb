"""The one writer of every file the launcher and its commands leave on disk, and of their modes.

A run directory holds secrets (`slurm.setup` lines with tokens end up in config.yaml, the scripts
and every checkpoint's config), on a filesystem many people use. The policy: folders 0700, files
0600 (a script 0700); with `run.shared_with_group=true` 0750 / 0640 / 0750. Never world-readable.

The policy is chosen once, where a top folder is made from the config (the run directory, a sweep
folder, a checkpoint folder outside the run, an export's output: `make_dir(path, Policy.of(cfg))`),
and every write below it inherits it from the folder it writes into (its group-read bit), so a
writer cannot forget it and the job's writers, which have no config at hand, follow the same rule:

  write / write_json   a whole file, atomically: a temporary file in the same folder, fsync, rename
                       (a reader sees the old content or the new, never half a file)
  append_line          one JSON line at the end of a log (sweep.jsonl, submissions.jsonl, ...)
  open_append          a log that a process writes into (Ray's node logs, actor logs)
  make_dir             a folder (and the missing folders above it, which get the policy too)
  seal / publish       a folder filled by others (trainer ranks, submitit, the exporter) brought
                       to the policy, and renamed into place whole (`tmp_step_N` -> `step_N`)

Not a umask: a umask of 077 in the launcher's process broke the local Ray cluster's token
handshake (docs/security.md).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


@dataclass(frozen=True)
class Policy:
    shared: bool = False   # run.shared_with_group: the group may read (never write); others nothing

    @property
    def dir_mode(self) -> int:
        return 0o750 if self.shared else 0o700

    @property
    def file_mode(self) -> int:
        return 0o640 if self.shared else 0o600

    @property
    def script_mode(self) -> int:
        return self.dir_mode   # executable by you (and your group when shared)

    @classmethod
    def of(cls, cfg: Any) -> "Policy":
        """The policy a config asks for (a schema.Config or a DictConfig)."""
        return cls(bool(cfg.run.shared_with_group))

    @classmethod
    def inherited(cls, folder: Path) -> "Policy":
        """The policy of an existing folder: shared only when its mode is the shared policy's own (the
        group may read, nobody else anything); any other folder (one this launcher did not make, a
        world-writable folder a link led to) gives the private policy, never a wider one."""
        return cls(stat.S_IMODE(os.stat(folder).st_mode) & 0o077 == Policy(True).dir_mode & 0o077)


PRIVATE = Policy(False)


def _policy(path: Path, policy: Policy | None) -> Policy:
    if policy is not None:
        return policy
    folder = path.parent
    while not folder.exists():   # a folder still to be made gets the policy of the nearest one above
        folder = folder.parent
    return Policy.inherited(folder)


class NotYours(PermissionError):
    """A top folder (the run directory, ...) that another user owns: they could replace what is written there."""


def not_yours(path: Path) -> NotYours | None:
    """NotYours when `path` (links followed) exists and another user owns it, else None."""
    path = Path(path)
    try:
        real = path.resolve()
        owner = os.stat(real).st_uid
    except FileNotFoundError:
        return None
    if owner == os.getuid():
        return None
    return NotYours(f"{path}{f' (a link to {real})' if real != path.absolute() else ''} belongs to user id {owner}, "
                    f"not to you: they could replace what the run writes there")


def make_dir(path: Path, policy: Policy | None = None) -> Path:
    """`path` as a folder with the policy's mode (also when it existed with wider modes); the
    folders made above it on the way get it too. Without `policy`: the parent's. Modes are set on
    the folder a link leads to (a run directory that is a symlink to a world-writable folder is
    made private); with `policy` given (a top folder, chosen from the config) that folder must be
    this user's (NotYours otherwise: its owner could replace anything written there)."""
    path = Path(path)
    explicit = policy is not None
    policy = _policy(path, policy)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=policy.dir_mode)
        except FileExistsError:  # made meanwhile by another task of the job
            pass
    for d in [path, *missing[1:]]:
        real = d.resolve()
        if real.is_dir():
            if explicit and d == path and (err := not_yours(d)) is not None:
                raise err
            _chmod_own(real, policy.dir_mode)
    return path


def _chmod_own(path: Path, mode: int) -> None:
    """chmod what this user owns (another task of the job, same user, may have made it first)."""
    try:
        os.chmod(path, mode)
    except PermissionError:
        pass


def write(path: Path, data: str | bytes, policy: Policy | None = None, executable: bool = False) -> Path:
    """Write a whole file atomically, with the policy's mode."""
    path = Path(path)
    policy = _policy(path, policy)
    if not path.parent.is_dir():
        make_dir(path.parent, policy)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), policy.script_mode if executable else policy.file_mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: Path, obj: Any, policy: Policy | None = None, indent: int | None = 1) -> Path:
    return write(path, json.dumps(obj, indent=indent) + "\n", policy)


def touch(path: Path, policy: Policy | None = None) -> Path:
    return write(path, b"", policy)


def copy(src: Path, dst: Path, policy: Policy | None = None) -> Path:
    return write(dst, Path(src).read_bytes(), policy)


def open_append(path: Path, policy: Policy | None = None, binary: bool = False) -> IO:
    """A log opened for appending, created with (or brought to) the policy's mode."""
    path = Path(path)
    policy = _policy(path, policy)
    if not path.parent.is_dir():
        make_dir(path.parent, policy)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, policy.file_mode)
    try:
        os.fchmod(fd, policy.file_mode)
    except PermissionError:
        pass
    return os.fdopen(fd, "ab" if binary else "a")


def append_line(path: Path, row: dict, policy: Policy | None = None) -> None:
    """One JSON line at the end of `path` (one write: a reader sees whole lines, or a last one
    being written, which readers skip)."""
    with open_append(path, policy) as f:
        f.write(json.dumps(row) + "\n")


def seal(root: Path, policy: Policy | None = None) -> None:
    """Bring a folder written by others to the policy: every folder below it the folder mode, every
    file the file mode (the script mode when its owner may execute it). Symlinks are left alone."""
    root = Path(root)
    policy = policy or Policy.inherited(root.parent)
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        if p.is_dir():
            _chmod_own(p, policy.dir_mode)
        elif p.is_file():
            _chmod_own(p, policy.script_mode if os.stat(p).st_mode & stat.S_IXUSR else policy.file_mode)


def publish(tmp: Path, final: Path, policy: Policy | None = None) -> Path:
    """A folder written whole in `tmp`: sealed, synced, then renamed to `final` (replacing an
    earlier one), so `final` either does not exist or is complete."""
    tmp, final = Path(tmp), Path(final)
    seal(tmp, policy or Policy.inherited(final.parent))
    fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def fsync_tree(root: Path) -> None:
    for p in Path(root).rglob("*"):
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
