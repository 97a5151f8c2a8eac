"""The frontend's side of the engine protocol, without I/O (hypercorn's and h11's style).

What the frontend says to the engine is encoded here into an `Outgoing` record (its kind, its
size, and how to write it into ring space), and what the engine says is decoded here from a
record's (kind, payload): `Ready`, `StepView`, an `Event` or the `RemoteError` of its death.
The trio client (`_engine_client`), the synchronous one (`_sync_client`) and the tests' ring
client keep only their waiting policy: when to reserve, peek and release, and what to do with
what `receive` returns. Before this, each encoded ADD and decoded READY/DEAD by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from ....common.wire import SamplingOptions
from ...protocol import _messages as P
from ...protocol._errors import RemoteError
from ...protocol._step_record import StepView

Incoming = (
    P.Ready | StepView | P.UtilityResult | P.PromptLogprobsChunk | P.RequestError | RemoteError
)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One request-ring record: reserve `size` bytes, `write` into them, commit as `kind`."""

    kind: int
    size: int
    write: Callable[[memoryview], None]


class ProtocolError(RuntimeError):
    """The engine sent a record of a kind the frontend does not know (a version mismatch)."""


class EngineConnection:
    """Encodes the frontend's records and decodes the engine's; holds no I/O and no state
    beyond its codecs, so every client shares it."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._ready = msgspec.msgpack.Decoder(P.Ready)
        self._event = msgspec.msgpack.Decoder(P.Event)
        self._dead = msgspec.msgpack.Decoder(RemoteError)

    # -- frontend -> engine -----------------------------------------------------------------

    def encode_add(
        self,
        rnum: int,
        options: SamplingOptions,
        max_tokens: int,
        ids: Sequence[int] | np.ndarray,
        grammar: str = "",
        num_output_tokens: int = 0,
        *,
        cache_salt: str = "",
        prompt_embeds: bytes = b"",
        lora_id: int = 0,
    ) -> Outgoing:
        """ADD `ids` (prompt, then `num_output_tokens` already generated when resumed;
        a prompt of `prompt_embeds` has placeholder ids)."""
        add = P.AddHeader(
            rnum,
            options,
            max_tokens,
            time.time(),
            grammar,
            num_output_tokens,
            cache_salt,
            prompt_embeds,
            lora_id,
        )
        header = self._encoder.encode(add)
        tokens = np.asarray(ids, "<i4")
        _, size = P.add_size(header, len(tokens))
        return Outgoing(P.ADD, size, lambda view: P.write_add(view, header, tokens))

    def encode_abort(self, rnums: Sequence[int]) -> Outgoing:
        return _bytes(P.ABORT, np.asarray(rnums, "<u8").tobytes())

    def encode_utility(
        self, call_id: int, method: str, args: list[object] | None = None
    ) -> Outgoing:
        return _bytes(P.UTILITY, self._encoder.encode(P.UtilityCall(call_id, method, args or [])))

    def encode_shutdown(self, mode: str, timeout: float) -> Outgoing:
        return _bytes(P.SHUTDOWN, self._encoder.encode(P.Shutdown(mode, timeout)))

    # -- engine -> frontend -----------------------------------------------------------------

    def receive(self, kind: int, payload: memoryview) -> Incoming:
        """The record decoded. A `StepView` is a view of `payload`: read it before the record
        is released; the others are copies.

        Raises:
            ProtocolError: a kind this frontend does not know.
        """
        if kind == P.STEP:
            return StepView(payload)
        if kind == P.EVENT:
            return self._event.decode(payload)
        if kind == P.READY:
            return self._ready.decode(payload)
        if kind == P.DEAD:
            return self._dead.decode(payload)
        raise ProtocolError(
            f"the engine sent a record of kind {kind}, which this frontend does not know"
        )

    def ready(self, kind: int, payload: memoryview) -> P.Ready | RemoteError:
        """The engine's first record as READY, or the root cause of what came instead: its
        DEAD record's, or a protocol error naming the kind."""
        if kind == P.READY:
            return self._ready.decode(payload)
        if kind == P.DEAD:
            return self._dead.decode(payload)
        return RemoteError("engine", "ProtocolError", f"record kind {kind} before READY")


def _bytes(kind: int, data: bytes) -> Outgoing:
    def write(view: memoryview) -> None:
        view[:] = data

    return Outgoing(kind, len(data), write)
