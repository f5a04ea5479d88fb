"""What the shim has applied in this process, and the small helpers every patch module shares."""

from __future__ import annotations

APPLIED: list[str] = []


def is_cpu(device: str) -> bool:
    return not str(device).startswith("cuda")


def once(name: str) -> bool:
    """True the first time `name` is asked for (and records it in APPLIED); False after."""
    if name in APPLIED:
        return False
    APPLIED.append(name)
    return True


def installed(package: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False
