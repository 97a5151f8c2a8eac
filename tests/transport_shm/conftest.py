from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .peers import Peers


@pytest.fixture
def peers() -> Iterator[Peers]:
    p = Peers()
    try:
        yield p
    finally:
        p.close()


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("trillm-")}


@pytest.fixture
def shm_names() -> object:
    """The trillm names now in /dev/shm, as a function."""
    return _shm_names
