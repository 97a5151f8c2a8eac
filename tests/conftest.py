from __future__ import annotations

from typing import Any

import pytest

from .grammars import smollm2_ll_tokenizer


@pytest.fixture(scope="session")
def ll_tokenizer() -> Any:
    """The default model's llguidance tokenizer (built once: about a second)."""
    return smollm2_ll_tokenizer()
