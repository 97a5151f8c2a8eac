"""Wire formats between the frontend and the engine process (DESIGN.md §4).

Every message is one ring record whose `kind` is one of the constants below. Hot-path records
(ADD's prompt tokens, ABORT, STEP) are raw little-endian arrays behind a small fixed header;
rare ones are msgpack of `array_like` structs, whose field order is wire ABI (append only).
Request numbers (u64), never string ids, cross the boundary.

Request ring (frontend -> engine):
- ADD:      u32 header_len | msgpack `AddHeader` | pad to 4 | i32 prompt tokens
- ABORT:    u64 rnums
- UTILITY:  msgpack `UtilityCall` (method from `UTILITY_METHODS`)
- SHUTDOWN: msgpack `Shutdown`

Output ring (engine -> frontend):
- READY:    msgpack `Ready` (post-initialisation facts)
- STEP:     one columnar record per engine step (`write_step`, `StepView`)
- EVENT:    msgpack `Event`: a `UtilityResult`, `PromptLogprobsChunk` or `RequestError`
- DEAD:     msgpack `RemoteError`, the engine's last record

Besides records, the engine bumps the output ring's heartbeat word every `HEARTBEAT_INTERVAL`
seconds (`core._heartbeat`); the frontend's watchdog (`client._watchdog`) reads it.
"""

from __future__ import annotations

import struct
from typing import Final

import msgspec
import numpy as np

from ...common.wire import KernelChoice, SamplingOptions

ADD: Final = 1
ABORT: Final = 2
UTILITY: Final = 3
SHUTDOWN: Final = 4
READY: Final = 10
STEP: Final = 11
EVENT: Final = 12
DEAD: Final = 13

# The engine process's entry point, run as `python -m ENGINE_MAIN <EngineArgs JSON>`: the one
# name of the engine's code the frontend knows (it spawns it, it never imports it).
ENGINE_MAIN: Final = "trillm.engine.core"

HEARTBEAT_INTERVAL: Final = 0.1  # seconds between the engine's beats
MIN_WATCHDOG_TIMEOUT: Final = 5 * HEARTBEAT_INTERVAL  # a shorter one would fire on jitter

# The engine's control calls (`EngineCore._utility`); the frontend refuses any other name.
# sleep: args [level 1|2]; start_profile: args [directory, file name prefix];
# load_lora_adapter: args [name, path, base_model_name, id]; unload_lora_adapter: args [id].
UTILITY_METHODS: Final = frozenset(
    {
        "reset_prefix_cache",
        "stats",
        "ping",
        "sleep",
        "wake_up",
        "is_sleeping",
        "pause",
        "resume",
        "is_paused",
        "start_profile",
        "stop_profile",
        "load_lora_adapter",
        "unload_lora_adapter",
    }
)


class AddHeader(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """ADD's header; the prompt tokens follow as raw int32. Field order is ABI."""

    rnum: int
    options: SamplingOptions
    max_tokens: int
    arrival_time: float
    grammar: str = ""  # structured outputs: an llguidance grammar the frontend checked
    # A request resumed on a restarted engine: the last `num_output_tokens` of the tokens
    # that follow were generated before (outputs, not prompt: penalties, min_tokens and
    # max_tokens count them, a grammar replays them).
    num_output_tokens: int = 0
    # vLLM's cache_salt ("": none): mixed into the first block's hash (`core._kv_cache_manager`).
    cache_salt: str = ""
    # The prompt as embeddings (vLLM's prompt_embeds, `--enable-prompt-embeds`): float32
    # little-endian [prompt tokens, hidden size]; the prompt's token ids are placeholders.
    prompt_embeds: bytes = b""
    # The LoRA adapter's id (`LoraModule.lora_int_id`; 0: the base model).
    lora_id: int = 0


class UtilityCall(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A control call; answered by a `UtilityResult` with its `call_id`."""

    call_id: int
    method: str  # one of UTILITY_METHODS
    args: list[object] = []  # positional, per method (sleep: [level])


class Shutdown(msgspec.Struct, array_like=True, gc=False, frozen=True):
    mode: str  # "drain": stop admitting, finish or time out; "abort": finish all now
    timeout: float = 30.0


class Ready(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """What the frontend learns once the engine is up. Field order is ABI."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    pid: int
    kernels: KernelChoice | None = None  # what the model runs with (None: no model)
    hidden_size: int = 0  # the width of a prompt embedding (`AddHeader.prompt_embeds`)
    # (id, digest) of the LoRA adapters loaded: a restarted engine skips one that no longer
    # loads, and the frontend drops what is not here
    loras: list[tuple[int, str]] = []


class UtilityResult(msgspec.Struct, tag="utility_result", array_like=True, gc=False, frozen=True):
    """The engine's answer to a `UtilityCall`. Field order is ABI (after the tag)."""

    call_id: int
    ok: bool
    result: object = None  # the method's value, or the error's message when not ok


class PromptLogprobsChunk(
    msgspec.Struct, tag="prompt_logprobs", array_like=True, gc=False, frozen=True
):
    """One prefill chunk's prompt logprobs of request `rnum`: little-endian arrays, `k` top
    entries per position (0: none). Field order is ABI (after the tag)."""

    rnum: int
    first_position: int
    k: int
    logprobs: bytes  # f32 per position
    topk_ids: bytes = b""  # i32 [positions, k]
    topk_logprobs: bytes = b""  # f32 [positions, k]


class RequestError(msgspec.Struct, tag="request_error", array_like=True, gc=False, frozen=True):
    """The engine refused or failed request `rnum` alone (a grammar that did not compile, a
    mask that ran out of fuel); the others go on."""

    rnum: int
    message: str


# EVENT's payload: msgpack of one of these, told apart by its tag (the first array element).
Event = UtilityResult | PromptLogprobsChunk | RequestError


_ADD_LEN = struct.Struct("<I")


def add_size(header: bytes, num_tokens: int) -> tuple[int, int]:
    """(offset of the tokens, total payload bytes) of an ADD record."""
    offset = (_ADD_LEN.size + len(header) + 3) & ~3
    return offset, offset + 4 * num_tokens


def write_add(view: memoryview, header: bytes, tokens: np.ndarray) -> None:
    """Write an ADD record (`add_size(header, len(tokens))[1]` bytes) into `view`: the header's
    length, the header, padding, the int32 tokens. Mirrors `write_step`."""
    offset, size = add_size(header, len(tokens))
    _ADD_LEN.pack_into(view, 0, len(header))
    view[_ADD_LEN.size : _ADD_LEN.size + len(header)] = header
    view[offset:size] = tokens.astype("<i4", copy=False).view(np.uint8).data


def unpack_add(
    payload: memoryview, decoder: msgspec.msgpack.Decoder[AddHeader]
) -> tuple[AddHeader, memoryview]:
    """The header and a view of the int32 prompt tokens of an ADD payload."""
    (length,) = _ADD_LEN.unpack_from(payload)
    header = decoder.decode(payload[_ADD_LEN.size : _ADD_LEN.size + length])
    offset = (_ADD_LEN.size + length + 3) & ~3
    return header, payload[offset:].cast("i")
