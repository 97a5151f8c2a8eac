"""Helpers for the grammar tests: the default model's llguidance tokenizer, and a check that a
grammar accepts a text exactly."""

from __future__ import annotations

from typing import Any

import llguidance

from trillm.default_model import default_model_dir
from trillm.engine.core._grammar import load_ll_tokenizer

VOCAB = 49152  # SmolLM2's
EOS = 2


def smollm2_ll_tokenizer() -> Any:
    return load_ll_tokenizer(str(default_model_dir(progress=False)), VOCAB, [EOS])


def accepts(grammar: str, text: str, tokenizer: Any) -> bool:
    """Whether `grammar` takes the whole of `text` (tokenised as the model would) and may end."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return bool(matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting())
