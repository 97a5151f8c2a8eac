"""The prompts `bench_serve.py` sends: random token ids, ShareGPT conversations, shared prefixes.

Random prompts are drawn from the target tokenizer's vocabulary (special tokens left out). As
token-id lists a completions request carries exactly the length asked for, but not every server
takes ids (`transformers serve` wants a string). As text, a decode/encode round trip changes
the length, so `exact_text` re-encodes and trims until the text encodes to exactly the asked
length, as vLLM's random dataset does. Chat requests add the chat template's own tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SampleRequest:
    """One prompt (token ids or text), its length in tokens, and the output length to ask."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int


class DatasetError(ValueError):
    """The dataset options or file cannot produce the requested prompts."""


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a directory, a .gguf file or a hub id, as trillm loads it.

    Imported late: it imports transformers and torch, which are slow.
    """
    from trillm.engine.client.inputs._tokenizer import load_tokenizer as trillm_load_tokenizer

    return trillm_load_tokenizer(path)


def normal_token_ids(tokenizer: Any) -> np.ndarray:
    """Every token id of the vocabulary except the special ones (no EOS inside a prompt)."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    """n lengths uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), not {range_ratio}")
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_requests(
    tokenizer: Any,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    rng: np.random.Generator,
    *,
    as_text: bool = False,
    prefix: list[int] | None = None,
) -> list[SampleRequest]:
    """`num` prompts of random token ids (after `prefix`, if given), lengths as in vLLM."""
    vocab = normal_token_ids(tokenizer)
    in_lens = sample_lengths(rng, input_len, range_ratio, num)
    out_lens = sample_lengths(rng, output_len, range_ratio, num)
    requests = []
    for in_len, out_len in zip(in_lens, out_lens, strict=True):
        ids = (prefix or []) + [int(t) for t in rng.choice(vocab, size=in_len)]
        if as_text:
            text, length = exact_text(tokenizer, ids, rng, vocab)
            requests.append(SampleRequest(text, length, out_len))
        else:
            requests.append(SampleRequest(ids, len(ids), out_len))
    return requests


def exact_text(
    tokenizer: Any, ids: list[int], rng: np.random.Generator, vocab: np.ndarray
) -> tuple[str, int]:
    """Text that encodes to `len(ids)` tokens: decode, re-encode, trim or top up, repeat.

    Merges across token boundaries make the round trip shorter or longer; a few rounds settle
    it. If they do not, the text and its true length are returned, so the report stays honest.
    """
    target = len(ids)
    text = tokenizer.decode(ids)
    for _ in range(16):
        got = tokenizer.encode(text, add_special_tokens=False)
        if len(got) == target:
            return text, target
        if len(got) > target:
            got = got[:target]
        else:
            got = got + [int(t) for t in rng.choice(vocab, size=target - len(got))]
        text = tokenizer.decode(got)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def prefix_repetition_requests(
    tokenizer: Any,
    num: int,
    prefix_len: int,
    num_prefixes: int,
    suffix_len: int,
    output_len: int,
    range_ratio: float,
    rng: np.random.Generator,
    *,
    as_text: bool = False,
) -> list[SampleRequest]:
    """Prompts that share one of `num_prefixes` random prefixes, with random suffixes.

    Prefixes cycle, so with prefix caching every prompt after the first per prefix skips
    `prefix_len` tokens of prefill: the TTFT gap against `random` shows the cache.
    """
    if num_prefixes < 1 or prefix_len < 1:
        raise DatasetError("--prefix-len and --num-prefixes must be >= 1")
    vocab = normal_token_ids(tokenizer)
    prefixes = [[int(t) for t in rng.choice(vocab, size=prefix_len)] for _ in range(num_prefixes)]
    requests = []
    for i in range(num):
        requests += random_requests(
            tokenizer, 1, suffix_len, output_len, range_ratio, rng,
            as_text=as_text, prefix=prefixes[i % num_prefixes],
        )  # fmt: skip
    return requests


def sharegpt_requests(
    path: Path,
    num: int,
    tokenizer: Any | None,
    rng: np.random.Generator,
    *,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """The first human turn of shuffled conversations as prompts; the reply's length as output.

    Without a tokenizer the prompt length is 0 here (the server's usage reports it) and the
    output length must be given with `output_len`.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DatasetError(f"cannot read the ShareGPT file {path}: {e}") from None
    pairs = [
        (c["conversations"][0]["value"], c["conversations"][1]["value"])
        for c in data
        if len(c.get("conversations", [])) >= 2
    ]
    if tokenizer is None and output_len is None:
        raise DatasetError("sharegpt without a tokenizer needs --sharegpt-output-len")
    order = rng.permutation(len(pairs))
    requests: list[SampleRequest] = []
    for i in order:
        prompt, reply = pairs[int(i)]
        in_len = len(tokenizer.encode(prompt)) if tokenizer is not None else 0
        if output_len is not None:
            out_len = output_len
        elif tokenizer is not None:
            out_len = len(tokenizer.encode(reply))
        if (output_len is None and out_len < 4) or (tokenizer is not None and in_len < 4):
            continue  # vLLM drops these too: too short to measure decoding
        requests.append(SampleRequest(prompt, in_len, out_len))
        if len(requests) == num:
            return requests
    raise DatasetError(f"{path} has {len(requests)} usable conversations, fewer than {num}")
