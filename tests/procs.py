"""Process facts the tests check, read from /proc."""

from __future__ import annotations

import os


def is_dead(pid: int) -> bool:
    """Whether `pid` is gone or a zombie (killed, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def children(pid: int) -> list[int]:
    """The pids of `pid`'s children (spawned by any of its threads)."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
    except FileNotFoundError:
        pass
    return found
