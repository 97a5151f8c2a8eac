"""Wire formats: the STEP record's columns and the ADD record round-trip through a ring."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from trillm.engine.protocol import _messages as P
from trillm.engine.protocol._errors import RemoteError
from trillm.engine.protocol._step_record import StepView, write_step
from trillm.gpu import SamplingOptions
from trillm.transport_shm import RingReader, RingWriter


def ring_pair() -> tuple[RingWriter, RingReader]:
    writer = RingWriter.create(1 << 16)
    reader = RingReader.attach(writer.address.dup())
    writer.wait_attached(timeout=5)
    return writer, reader


def test_step_record_columns_are_views_of_what_was_written() -> None:
    writer, reader = ring_pair()
    with writer, reader:
        write_step(
            writer,
            42,
            np.array([7, 2**63 + 1, 9], np.uint64),
            np.array([0, 1, 3, 3], np.uint32),
            np.array([11, 12, 13], np.int32),
            np.array([0, 2, 3], np.uint8),
            logprobs=np.array([-0.1, -0.2, -0.3], np.float32),
            topk_ids=np.array([[11, 1], [12, 2], [13, 3]], np.int32),
            topk_logprobs=np.full((3, 2), -1.0, np.float32),
            num_cached_tokens=np.array([0, 16, 0], np.uint32),
        )
        kind, payload = reader.peek(timeout=0)
        assert kind == P.STEP
        view = StepView(payload)
        assert (view.step, view.num_rows, view.num_tokens, view.num_finished) == (42, 3, 3, 2)
        assert view.rnums.tolist() == [7, 2**63 + 1, 9]
        assert view.tokens[view.tok_offsets[1] : view.tok_offsets[2]].tolist() == [12, 13]
        assert view.finish.tolist() == [0, 2, 3]
        assert (
            view.logprobs is not None
            and view.logprobs.tolist() == np.float32([-0.1, -0.2, -0.3]).tolist()
        )
        assert view.topk_ids is not None and view.topk_ids.tolist() == [[11, 1], [12, 2], [13, 3]]
        assert view.num_cached_tokens is not None and view.num_cached_tokens.tolist() == [0, 16, 0]
        assert view.rnums.ctypes.data % 8 == 0
        del view
        reader.release()


def test_step_record_without_optional_sections() -> None:
    writer, reader = ring_pair()
    with writer, reader:
        write_step(
            writer,
            1,
            np.array([5], np.uint64),
            np.array([0, 1], np.uint32),
            np.array([99], np.int32),
            np.zeros(1, np.uint8),
        )
        view = StepView(reader.peek(timeout=0)[1])
        assert view.logprobs is None and view.topk_ids is None and view.num_cached_tokens is None
        assert view.num_finished == 0 and view.tokens.tolist() == [99]


def test_add_record_round_trips() -> None:
    writer, reader = ring_pair()
    with writer, reader:
        options = SamplingOptions(temperature=0.5, top_p=0.9, seed=4, stop_token_ids=(3,))
        header = msgspec.msgpack.encode(P.AddHeader(17, options, 64, 123.5))
        _, size = P.add_size(header, 3)
        P.write_add(writer.reserve(size), header, np.array([1, 2, 3]))
        writer.commit(P.ADD)
        kind, payload = reader.peek(timeout=0)
        got, tokens = P.unpack_add(payload, msgspec.msgpack.Decoder(P.AddHeader))
        assert kind == P.ADD and got.rnum == 17 and got.options == options and got.max_tokens == 64
        assert tokens.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "event",
    [
        P.UtilityResult(3, True, {"num_running": 1}),
        P.UtilityResult(4, False, "no such method"),
        P.PromptLogprobsChunk(7, 1, 2, b"\x00" * 8, b"\x01" * 16, b"\x02" * 16),
        P.RequestError(9, "the grammar did not compile"),
    ],
)
def test_events_are_one_tagged_union(event: object) -> None:
    encoded = msgspec.msgpack.encode(event)
    assert msgspec.msgpack.decode(encoded)[0] == type(event).__struct_config__.tag
    assert msgspec.msgpack.decode(encoded, type=P.Event) == event


def test_the_connection_encodes_what_the_engine_decodes() -> None:
    from trillm.engine.client.engines._connection import EngineConnection, ProtocolError

    conn = EngineConnection()
    options = SamplingOptions(temperature=0.0, stop_token_ids=(5,))
    add = conn.encode_add(3, options, 16, [9, 8, 7], grammar="start: x", num_output_tokens=1)
    view = memoryview(bytearray(add.size))
    add.write(view)
    header, tokens = P.unpack_add(view, msgspec.msgpack.Decoder(P.AddHeader))
    assert (header.rnum, header.options, header.max_tokens) == (3, options, 16)
    assert (header.grammar, header.num_output_tokens, tokens.tolist()) == ("start: x", 1, [9, 8, 7])
    abort = conn.encode_abort([1, 2])
    assert abort.kind == P.ABORT and abort.size == 16
    dead = msgspec.msgpack.encode(RemoteError("engine", "ValueError", "bad"))
    assert conn.receive(P.DEAD, memoryview(dead)) == RemoteError("engine", "ValueError", "bad")
    assert conn.ready(P.STEP, memoryview(b"")) == RemoteError(
        "engine", "ProtocolError", "record kind 11 before READY"
    )
    with pytest.raises(ProtocolError, match="kind 99"):
        conn.receive(99, memoryview(b""))
