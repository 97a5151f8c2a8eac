"""`--async-scheduling` through a real engine process: the same tokens as the synchronous
engine, token for token, with stops, length caps and aborts mid-flight, and with requests that
keep the steps synchronous mixed in. The tiny model on the CPU (real rings, the C step)."""

from __future__ import annotations

import pytest

from trillm.engine.protocol._step_record import FinishReason
from trillm.gpu import SamplingOptions

from . import test_engine_process
from .ring_client import EngineClient
from .test_engine_control import call, pump_for

tiny_dir = test_engine_process.tiny_dir
client_for = test_engine_process.client_for

PROMPTS = test_engine_process.PROMPTS  # 8 prompts of 1 to 48 tokens
MAX_TOKENS = (7, 19, 3, 26, 12, 1, 22, 15)
# The tiny model's greedy text repeats one token, which a wrong input id would not change:
# seeded sampling (each request its own generator, whatever else is in the batch) varies.
# Penalized requests are greedy: their text would repeat one token, which the penalties break.
PENALTY = {"temperature": 0.0, "frequency_penalty": 1.5}


def options_of(rnum: int, **kw: object) -> SamplingOptions:
    values: dict[str, object] = {"temperature": 1.0, "seed": rnum, "ignore_eos": True, **kw}
    return SamplingOptions(**values)  # type: ignore[arg-type]


def run_batch(client: EngineClient, stops: dict[int, int], penalized: tuple[int, ...]) -> None:
    """The 8 prompts with their max_tokens; `stops` gives a request a stop token (its EOS),
    `penalized` requests penalties (which keep the steps synchronous)."""
    for rnum, prompt in enumerate(PROMPTS):
        extra: dict[str, object] = dict(PENALTY) if rnum in penalized else {}
        if rnum in stops:
            extra["stop_token_ids"] = (stops[rnum],)
        client.add(rnum, prompt, MAX_TOKENS[rnum], options_of(rnum, **extra))
    client.run_until(lambda: len(client.finish) == len(PROMPTS), timeout=120)


def stop_tokens(reference: EngineClient) -> dict[int, int]:
    """For three long requests, a token they sample mid-way (not their first): a stop there."""
    return {r: reference.tokens[r][len(reference.tokens[r]) // 2] for r in (1, 3, 6)}


@pytest.mark.timeout(300)
def test_async_scheduling_gives_the_synchronous_tokens(client_for: object) -> None:
    start = client_for  # type: ignore[assignment]
    # 4 rows for 8 requests: rows are given to new requests while steps are in flight.
    plain = start(max_num_seqs=4)  # type: ignore[operator]
    run_batch(plain, {}, ())
    stops = stop_tokens(plain)
    sync = start(max_num_seqs=4)  # type: ignore[operator]
    run_batch(sync, stops, ())
    ahead = start(async_scheduling=True, max_num_seqs=4)  # type: ignore[operator]
    run_batch(ahead, stops, ())
    assert dict(ahead.tokens) == dict(sync.tokens)
    assert ahead.finish == sync.finish
    for rnum in stops:  # each stopped at its stop token, before max_tokens
        assert sync.finish[rnum] == FinishReason.STOP
        assert len(sync.tokens[rnum]) < MAX_TOKENS[rnum]
    assert {sync.finish[r] for r in range(8) if r not in stops} == {FinishReason.LENGTH}
    # A request that keeps the steps synchronous (penalties) among them: the same again.
    mixed_sync = start(max_num_seqs=4)  # type: ignore[operator]
    run_batch(mixed_sync, stops, (2, 4))
    mixed = start(async_scheduling=True, max_num_seqs=4)  # type: ignore[operator]
    run_batch(mixed, stops, (2, 4))
    assert dict(mixed.tokens) == dict(mixed_sync.tokens)
    assert mixed.finish == mixed_sync.finish
    assert len(set(mixed.tokens[4])) > 1  # the penalty was applied


@pytest.mark.timeout(180)
def test_an_abort_mid_flight_ends_the_request_and_the_others_go_on(client_for: object) -> None:
    reference: EngineClient = client_for()  # type: ignore[operator]
    reference.add(1, PROMPTS[1], 40, options_of(1))
    reference.add(2, PROMPTS[4], 40, options_of(2))
    reference.run_until(lambda: len(reference.finish) == 2)
    client: EngineClient = client_for(async_scheduling=True)  # type: ignore[operator]
    client.add(1, PROMPTS[1], 40, options_of(1))
    client.add(2, PROMPTS[4], 40, options_of(2))
    client.run_until(lambda: len(client.tokens[1]) >= 5)
    client.abort([1])
    client.run_until(lambda: len(client.finish) == 2)
    assert client.finish == {1: FinishReason.ABORT, 2: FinishReason.LENGTH}
    got = client.tokens[1]
    assert got == reference.tokens[1][: len(got)] and len(got) < 40
    assert client.tokens[2] == reference.tokens[2]
    client.utility(1, "stats")
    client.run_until(lambda: any(getattr(e, "call_id", None) == 1 for e in client.events))
    stats = next(e for e in client.events if getattr(e, "call_id", None) == 1).result
    assert isinstance(stats, dict)
    assert stats["num_running"] == 0 and stats["kv_usage"] == 0.0


@pytest.mark.timeout(180)
def test_pause_and_sleep_mid_flight_answer_after_the_step_in_flight(client_for: object) -> None:
    reference: EngineClient = client_for()  # type: ignore[operator]
    reference.add(1, PROMPTS[1], 30, options_of(1))
    reference.run_until(lambda: 1 in reference.finish)
    client: EngineClient = client_for(async_scheduling=True)  # type: ignore[operator]
    client.add(1, PROMPTS[1], 30, options_of(1))
    client.run_until(lambda: len(client.tokens[1]) >= 3)
    assert call(client, 1, "pause").result == 1
    held = len(client.tokens[1])  # the step in flight was written before the answer
    pump_for(client, 0.5)
    assert len(client.tokens[1]) == held
    assert call(client, 2, "resume").result == 1
    client.run_until(lambda: 1 in client.finish)
    assert client.tokens[1] == reference.tokens[1]
    client.add(2, PROMPTS[1], 400, options_of(1))
    client.run_until(lambda: len(client.tokens[2]) >= 3)
    assert call(client, 3, "sleep", 1).result == 1  # aborted in flight, the KV cache freed
    assert client.finish[2] == FinishReason.ABORT
    assert call(client, 4, "wake_up").result == 1
    client.add(3, PROMPTS[1], 30, options_of(1))
    client.run_until(lambda: 3 in client.finish)
    assert client.tokens[3] == reference.tokens[1]


# Three TP 2 engines: `make test-slow`. The executor has no code of its own for steps ahead (the
# base class's ReadyOutput); `make test` runs the engine's side above at TP 1 and the TP 2
# executor in test_executor_multiproc.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_runs_steps_ahead_synchronously_with_the_same_tokens(client_for: object) -> None:
    """The multiprocess executor runs each step at once (no overlap), which is correct for
    steps scheduled ahead: the engine still applies each output one step late."""
    sync: EngineClient = client_for(tensor_parallel_size=2, max_num_seqs=4)  # type: ignore[operator]
    run_batch(sync, {}, ())
    stops = stop_tokens(sync)
    reference: EngineClient = client_for(tensor_parallel_size=2, max_num_seqs=4)  # type: ignore[operator]
    run_batch(reference, stops, ())
    ahead: EngineClient = client_for(  # type: ignore[operator]
        tensor_parallel_size=2, max_num_seqs=4, async_scheduling=True
    )
    run_batch(ahead, stops, ())
    assert dict(ahead.tokens) == dict(reference.tokens)
    assert ahead.finish == reference.finish
