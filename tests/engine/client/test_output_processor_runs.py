"""The output processor given rows of several tokens (speculative decoding's accepted runs):
a stop string that ends inside a run ends the request at the token that completes it, and
the run's later tokens are dropped from the text, token ids, logprobs and counts, as a step
of one token would never have produced them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from tokenizers import Tokenizer

from trillm.default_model import default_model_dir
from trillm.engine.client.outputs._detokenizer import IncrementalDetokenizer, StopChecker
from trillm.engine.client.outputs._output_processor import OutputProcessor, RequestState
from trillm.engine.client.outputs._outputs import Mailbox
from trillm.engine.protocol._step_record import StepView, write_step
from trillm.transport_shm import RingReader, RingWriter


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(default_model_dir(progress=False) / "tokenizer.json"))


@pytest.fixture
def rings() -> Iterator[tuple[RingWriter, RingReader]]:
    writer = RingWriter.create(1 << 16)
    reader = RingReader.attach(writer.address.dup())
    writer.wait_attached(timeout=5)
    with writer, reader:
        yield writer, reader


def open_request(
    processor: OutputProcessor, tokenizer: Tokenizer, stop: list[str] | None
) -> RequestState:
    state = RequestState(
        rnum=1,
        index=0,
        mailbox=Mailbox(),
        detokenizer=IncrementalDetokenizer(tokenizer, []),
        stop=StopChecker(stop) if stop else None,
        num_prompt_tokens=3,
        logprobs=0,
    )
    processor.add(state)
    return state


def step(
    rings: tuple[RingWriter, RingReader], processor: OutputProcessor, run: list[int]
) -> list[int]:
    """One STEP record carrying `run` as request 1's row (not finished by the engine); the
    requests to abort."""
    writer, reader = rings
    write_step(
        writer,
        0,
        np.array([1], np.uint64),
        np.array([0, len(run)], np.uint32),
        np.array(run, np.int32),
        np.array([0], np.uint8),
        logprobs=-np.arange(1, len(run) + 1, dtype=np.float32),
    )
    _, payload = reader.peek(timeout=0)
    to_abort = processor.process_step(StepView(payload))
    reader.release()
    return to_abort


def tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def test_a_stop_string_inside_a_run_cuts_it_at_the_token_that_completes_it(
    rings: tuple[RingWriter, RingReader], tokenizer: Tokenizer
) -> None:
    processor = OutputProcessor()
    state = open_request(processor, tokenizer, ["jumps"])
    head, tail = tokens(tokenizer, "The fox jumps"), tokens(tokenizer, " over the dog")
    to_abort = step(rings, processor, head + tail)
    (output,) = state.mailbox.pending.values()
    assert to_abort == [1]  # the engine ends it: it would generate on
    assert output.finish_reason == "stop" and output.stop_reason == "jumps"
    assert output.text == "The fox "
    assert output.token_ids == head  # the tokens after the one that completed "jumps": gone
    assert output.num_output_tokens == len(head) == state.num_output_tokens
    assert output.logprobs is not None and len(output.logprobs) == len(head)
    assert [lp.logprob for lp in output.logprobs] == pytest.approx(
        (-np.arange(1, len(head) + 1)).tolist()
    )
    assert state.finished and processor.get(1) is None


def test_a_run_without_its_stop_string_is_emitted_whole_and_held_text_waits(
    rings: tuple[RingWriter, RingReader], tokenizer: Tokenizer
) -> None:
    processor = OutputProcessor()
    state = open_request(processor, tokenizer, ["fox jumps"])
    run = tokens(tokenizer, "The quick fox")
    assert step(rings, processor, run) == []
    (output,) = state.mailbox.pending.values()
    assert output.finish_reason is None
    assert output.token_ids == run and output.num_output_tokens == len(run)
    assert output.text == "The quick "  # "fox" may still begin the stop string
    state.mailbox.pending.clear()
    assert step(rings, processor, tokens(tokenizer, " jumps high")) == [1]
    (output,) = state.mailbox.pending.values()
    assert output.text == "" and output.stop_reason == "fox jumps"
    assert output.token_ids == tokens(tokenizer, " jumps")


def test_without_stop_strings_a_run_is_one_push(
    rings: tuple[RingWriter, RingReader], tokenizer: Tokenizer
) -> None:
    processor = OutputProcessor()
    state = open_request(processor, tokenizer, None)
    run = tokens(tokenizer, "The fox jumps over")
    assert step(rings, processor, run) == []
    (output,) = state.mailbox.pending.values()
    assert output.text == "The fox jumps over" and output.token_ids == run


async def test_a_pooling_request_finishes_with_its_rows_and_no_text(
    rings: tuple[RingWriter, RingReader],
) -> None:
    """A pooling state has no detokeniser and no stop strings (`new_pooling_state`): its
    finishing record hands over the pooled rows, no text, no tokens."""
    processor = OutputProcessor()
    mailbox = Mailbox()
    state = RequestState(
        rnum=7, index=0, mailbox=mailbox, detokenizer=None, stop=None,
        num_prompt_tokens=4, logprobs=None,
    )  # fmt: skip
    processor.add(state)
    writer, reader = rings
    rows = np.array([[0.5, -1.0, 2.0]], np.float32)
    write_step(
        writer, 0, np.array([7], np.uint64), np.array([0, 0], np.uint32),
        np.zeros(0, np.int32), np.array([2], np.uint8),
        pooled_rnums=np.array([7], np.uint64), pooled=rows,
    )  # fmt: skip
    _, payload = reader.peek(timeout=0)
    assert processor.process_step(StepView(payload)) == []
    reader.release()
    (output,) = await mailbox.get()
    assert output.finished and output.text == "" and output.token_ids == []
    assert output.pooled is not None and np.array_equal(output.pooled, rows)
    assert processor.get(7) is None  # finished: out of the table
