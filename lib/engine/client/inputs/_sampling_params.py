"""User-facing sampling parameters (vLLM's and the OpenAI API's), validated once per request.

The frontend validates here, at the edge, and converts to the device side's `SamplingOptions`
(its wire form). Limits follow vLLM and OpenAI: n <= 128, logprobs <= 20, penalties in
[-2, 2], logit biases in [-100, 100]. Validation runs in `__post_init__`, so it also runs when
msgspec decodes a request body straight into this Struct (msgspec then reports the
`SamplingParamsError` message as its `ValidationError`).

Beyond them, every value must be one the sampler computes with in float32 without an infinity
or a NaN (issue 25: `temperature: 3.5e38` is inf in float32, and a grammar mask's -inf over it
is NaN: the request ended in an error after its 200): temperature in [0, 100] (OpenAI takes
[0, 2], vLLM any finite value; past about 10 sampling is already close to uniform),
repetition_penalty in [0.001, 1000] (vLLM: > 0; a tiny one divides logits into infinity), at
most 1,024 logit biases and 1,024 stop token ids (each costs work in every step), and token
ids below the vocabulary (`check_vocab`, which the HTTP edge calls before a response starts).
"""

from __future__ import annotations

import math

import msgspec
import msgspec.structs

from ....common.wire import SamplingOptions
from ._structured import StructuredOutputs

MAX_N = 128  # OpenAI's limit on choices per request
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit; vLLM's default max_logprobs
MAX_STOP_STRINGS = 64  # each one costs a search per generated token in the frontend
MAX_STOP_STRING_LENGTH = 1024  # held-back text is bounded by the longest stop string
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties, as OpenAI
MAX_ABS_LOGIT_BIAS = 100.0  # as OpenAI
SEED_LIMIT = 2**63  # seeds are in [0, 2**63): fits an int64 wherever it travels
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy (vLLM's _SAMPLING_EPS)
MAX_TEMPERATURE = 100.0  # logits / temperature stay finite and meaningful in float32
MIN_REPETITION_PENALTY = 1e-3  # logits / penalty stay finite in float32
MAX_REPETITION_PENALTY = 1e3
MAX_LOGIT_BIAS = 1024  # entries: each is a column written in every step
MAX_STOP_TOKEN_IDS = 1024
MAX_CACHE_SALT_LENGTH = 4096  # characters: it travels in every ADD and is hashed once

_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_BIAS_IDS = "logit_bias token ids"
_NUM_STOPS = "the number of stop strings"
_NUM_BIAS = "the number of logit_bias entries"
_NUM_STOP_IDS = "the number of stop_token_ids"


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range: the caller's mistake (an HTTP 400).

    Attributes:
        field: the parameter's name.
        value: the offending value.
    """

    def __init__(self, field: str, value: object, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


def _require(ok: bool, field: str, value: object, limit: str, *, subject: str = "") -> None:
    """Raise unless `ok`: "<subject or field> must be <limit>, got <value>"."""
    if not ok:
        message = f"{subject or field} must be {limit}, got {value!r}"
        raise SamplingParamsError(field, value, message)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one request's completions.

    `max_tokens=None` means up to the model's maximum length; `top_k` 0 or -1 means off (-1 is
    stored as 0); `logprobs` / `prompt_logprobs` ask for that many top logprobs per generated
    / prompt token (None: none). A temperature below 1e-5 samples greedily.

    Raises:
        SamplingParamsError: a parameter is out of range; the message names it, the value
            and the limit.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs: the output must match this (checked by `AsyncLLM` before the
    # request starts; the engine enforces it with a token mask every step).
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: requests share prefix-cache blocks only with requests of the same salt (a
    # tenant's key); None shares with the other unsalted requests. Mixed into the first
    # block's hash by the engine; not a sampling setting, but it travels with the request.
    cache_salt: str | None = None
    # vLLM's: at most this many tokens of reasoning, then the reasoning is closed (the
    # grammar writes </think>). Needs the server's reasoning parser (`LLMConfig`).
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        if self.top_k == -1:
            msgspec.structs.force_setattr(self, "top_k", 0)
        self._validate_lengths()
        self._validate_floats()
        self._validate_tokens()
        self._validate_cache_salt()

    def _validate_cache_salt(self) -> None:
        salt = self.cache_salt
        if salt is None:
            return
        if not salt:  # vLLM refuses it too: it would read as "no salt"
            raise SamplingParamsError(
                "cache_salt", salt, "cache_salt must be a non-empty string, or left out"
            )
        if len(salt) > MAX_CACHE_SALT_LENGTH:
            raise SamplingParamsError(
                "cache_salt",
                salt,
                f"cache_salt must be at most {MAX_CACHE_SALT_LENGTH} characters, got {len(salt)}",
            )

    def _validate_lengths(self) -> None:
        _require(1 <= self.n <= MAX_N, "n", self.n, f"between 1 and {MAX_N}")
        if self.max_tokens is not None:
            _require(self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
        _require(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"<= max_tokens ({self.max_tokens})",
            )
        if self.thinking_token_budget is not None:
            budget = self.thinking_token_budget
            _require(budget >= 0, "thinking_token_budget", budget, ">= 0")
        for field in ("logprobs", "prompt_logprobs"):
            k = getattr(self, field)
            if k is not None:
                _require(0 <= k <= MAX_LOGPROBS, field, k, f"between 0 and {MAX_LOGPROBS}")

    def _validate_floats(self) -> None:
        for field in _FLOAT_FIELDS:
            value = getattr(self, field)
            _require(math.isfinite(value), field, value, "finite")
        _require(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        limit = f"<= {MAX_TEMPERATURE:g}"
        _require(self.temperature <= MAX_TEMPERATURE, "temperature", self.temperature, limit)
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _require(self.top_k >= 0, "top_k", self.top_k, "-1, 0 (off) or >= 1")
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            _require(abs(value) <= MAX_ABS_PENALTY, field, value, "in [-2, 2]")
        penalty = self.repetition_penalty
        _require(
            MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            penalty,
            f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]",
        )
        if self.seed is not None:
            _require(0 <= self.seed < SEED_LIMIT, "seed", self.seed, "in [0, 2**63)")

    def _validate_tokens(self) -> None:
        num_bias, num_stop_ids = len(self.logit_bias or ()), len(self.stop_token_ids or ())
        limit = f"<= {MAX_LOGIT_BIAS}"
        _require(num_bias <= MAX_LOGIT_BIAS, "logit_bias", num_bias, limit, subject=_NUM_BIAS)
        limit = f"<= {MAX_STOP_TOKEN_IDS}"
        _require(
            num_stop_ids <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            num_stop_ids,
            limit,
            subject=_NUM_STOP_IDS,
        )
        for token_id, bias in (self.logit_bias or {}).items():
            _require(token_id >= 0, "logit_bias", token_id, ">= 0", subject=_BIAS_IDS)
            if not abs(bias) <= MAX_ABS_LOGIT_BIAS:  # (NaN fails too)
                raise SamplingParamsError(
                    "logit_bias",
                    bias,
                    f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}",
                )
        for token_id in self.stop_token_ids or ():
            _require(token_id >= 0, "stop_token_ids", token_id, ">= 0")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        limit = f"<= {MAX_STOP_STRINGS}"
        _require(len(stops) <= MAX_STOP_STRINGS, "stop", len(stops), limit, subject=_NUM_STOPS)
        for stop in stops:
            if not stop:
                raise SamplingParamsError("stop", stop, "stop strings must not be empty")
            if len(stop) > MAX_STOP_STRING_LENGTH:
                raise SamplingParamsError(
                    "stop",
                    stop,
                    f"stop strings must be at most {MAX_STOP_STRING_LENGTH} characters, "
                    f"got one of {len(stop)}",
                )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings as a tuple, duplicates removed, in the order given."""
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,)
        return tuple(dict.fromkeys(self.stop))

    def to_options(self, *, vocab_size: int) -> SamplingOptions:
        """The device side's options for this request (for n == 1, or unseeded children).

        Args:
            vocab_size: the model's vocabulary size; token ids must be below it.

        Returns:
            The sampler's options; a temperature below 1e-5 becomes greedy (0.0, with top-p,
            top-k and min-p off, as they cannot change an argmax).

        Raises:
            SamplingParamsError: a logit_bias or stop_token_ids id is >= vocab_size.
        """
        return self._options(self.seed, vocab_size)

    def child_options(self, index: int, *, vocab_size: int) -> SamplingOptions:
        """The options of child `index` of n: seeded children get `seed + index`.

        Distinct seeds keep the n completions of a seeded request different from each other
        and each one reproducible. The sum wraps modulo 2**63 to stay in range.

        Raises:
            IndexError: index is not in [0, n).
            SamplingParamsError: as `to_options`.
        """
        if not 0 <= index < self.n:
            raise IndexError(f"child index must be in [0, {self.n}) (n), got {index}")
        seed = None if self.seed is None else (self.seed + index) % SEED_LIMIT
        return self._options(seed, vocab_size)

    def check_vocab(self, vocab_size: int) -> None:
        """Check every token id (logit_bias keys, stop_token_ids) against the vocabulary.

        Raises:
            SamplingParamsError: an id is >= vocab_size; the message names the field, the
                id and the vocabulary's size.
        """
        limit = f"< vocab_size ({vocab_size})"
        for token_id in self.logit_bias or ():
            _require(token_id < vocab_size, "logit_bias", token_id, limit, subject=_BIAS_IDS)
        for token_id in self.stop_token_ids or ():
            _require(token_id < vocab_size, "stop_token_ids", token_id, limit)

    def _options(self, seed: int | None, vocab_size: int) -> SamplingOptions:
        self.check_vocab(vocab_size)
        logit_bias = tuple((t, float(b)) for t, b in (self.logit_bias or {}).items())
        stop_token_ids = tuple(self.stop_token_ids or ())
        greedy = self.temperature < GREEDY_TEMPERATURE
        return SamplingOptions(
            temperature=0.0 if greedy else float(self.temperature),
            top_p=1.0 if greedy else float(self.top_p),
            top_k=0 if greedy else self.top_k,
            min_p=0.0 if greedy else float(self.min_p),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            seed=seed,
            logit_bias=logit_bias,
            min_tokens=self.min_tokens,
            stop_token_ids=stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )
