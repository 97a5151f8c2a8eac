"""The engine's control calls (UTILITY): pause/resume, sleep/wake_up, profiling, titles.

Real engine processes through real rings (the test client of `ring_client`), the tiny model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from trillm.engine.protocol import _messages as P
from trillm.engine.protocol._step_record import FinishReason

from ...procs import children
from . import test_engine_process
from .ring_client import EngineClient

# The engine process tests' fixtures: the tiny model, engines started and closed for a test.
tiny_dir = test_engine_process.tiny_dir
client_for = test_engine_process.client_for

PROMPT = list(range(40, 73))


def call(client: EngineClient, call_id: int, method: str, *args: object) -> P.UtilityResult:
    """The engine's answer to one control call."""
    client.utility(call_id, method, *args)

    def answers() -> list[P.UtilityResult]:
        return [e for e in client.events if isinstance(e, P.UtilityResult) and e.call_id == call_id]

    client.run_until(lambda: bool(answers()), timeout=30)
    return answers()[0]


def cmdline(pid: int) -> str:
    """What `ps -o args` shows for `pid`: its title, once set."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode()


def pump_for(client: EngineClient, seconds: float) -> None:
    """Read whatever the engine writes for `seconds` (to show that it writes nothing)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        client.pump(0.05)


@pytest.mark.timeout(120)
def test_pause_holds_running_requests_and_resume_continues_them(client_for: object) -> None:
    client = client_for()  # type: ignore[operator]
    client.add(0, PROMPT, 24)  # the reference, on the same engine (one start, not two)
    client.run_until(lambda: 0 in client.finish)
    client.add(1, PROMPT, 24)
    client.run_until(lambda: len(client.tokens[1]) >= 2)
    assert call(client, 1, "pause").result == 1  # one request held
    assert call(client, 2, "is_paused").result is True
    held = len(client.tokens[1])
    client.add(2, PROMPT, 4)  # admitted to the queue, not scheduled
    pump_for(client, 0.5)
    assert len(client.tokens[1]) == held and client.tokens[2] == []
    client.abort([2])  # an abort is still reported while paused
    client.run_until(lambda: client.finish.get(2) == FinishReason.ABORT)
    assert call(client, 3, "resume").result == 1
    client.run_until(lambda: 1 in client.finish)
    assert client.tokens[1] == client.tokens[0]
    assert call(client, 4, "is_paused").result is False
    # The abort's flush was a step of the scheduler's count too: the STEP records and the
    # statistics number the same steps (they drifted apart by one per flush).
    stats = call(client, 5, "stats").result
    assert isinstance(stats, dict) and client.last_step < stats["step"]


@pytest.mark.timeout(120)
def test_sleep_aborts_frees_the_kv_cache_and_wake_up_serves_the_same_tokens(
    client_for: object,
) -> None:
    client = client_for()  # type: ignore[operator]
    client.add(1, PROMPT, 16)
    client.run_until(lambda: 1 in client.finish)
    client.add(2, PROMPT, 200)  # in flight at the sleep: aborted, as vLLM's default mode
    client.run_until(lambda: len(client.tokens[2]) >= 1)
    answer = call(client, 1, "sleep", 1)
    assert answer.ok and answer.result == 1
    client.run_until(lambda: client.finish.get(2) == FinishReason.ABORT)
    assert call(client, 2, "is_sleeping").result == 1
    assert call(client, 3, "sleep", 1).ok  # asleep already: nothing to do
    refused = call(client, 4, "sleep", 2)
    assert not refused.ok
    assert refused.result == (
        "the engine is asleep at level 1: wake it up before sleeping at level 2"
    )
    client.add(3, PROMPT, 16)  # waits: nothing steps while asleep
    pump_for(client, 0.3)
    assert client.tokens[3] == []
    assert call(client, 5, "wake_up").result == 1
    client.run_until(lambda: 3 in client.finish)
    assert client.tokens[3] == client.tokens[1]
    assert call(client, 6, "is_sleeping").result == 0
    # The prefix cache was forgotten at the sleep (its blocks' contents were freed).
    assert client.cached[3] == 0


@pytest.mark.timeout(60)
def test_sleep_refuses_a_bad_level_and_an_unknown_method(client_for: object) -> None:
    client = client_for()  # type: ignore[operator]
    for call_id, level in enumerate((0, 3, "1"), start=1):
        answer = call(client, call_id, "sleep", level)
        assert not answer.ok
        assert answer.result == f"sleep level must be 1 or 2, got {level!r}"
    answer = call(client, 9, "sleep_forever")
    assert (answer.ok, answer.result) == (False, "unknown utility method 'sleep_forever'")


@pytest.mark.timeout(120)
def test_profile_writes_a_chrome_trace_of_the_engine_process(
    client_for: object, tmp_path: Path
) -> None:
    client = client_for()  # type: ignore[operator]
    assert call(client, 1, "start_profile").result == (
        "start_profile needs a directory for the trace (--profiler-dir)"
    )
    stopped = call(client, 2, "stop_profile")
    assert (stopped.ok, stopped.result) == (
        False,
        "no profile is running: start one first (POST /start_profile)",
    )
    started = call(client, 3, "start_profile", str(tmp_path / "traces"))
    assert started.ok
    again = call(client, 4, "start_profile", str(tmp_path / "traces"))
    assert not again.ok and "a profile is running already" in str(again.result)
    client.add(1, PROMPT, 8)
    client.run_until(lambda: 1 in client.finish)
    stopped = call(client, 5, "stop_profile")
    assert stopped.ok and stopped.result == started.result
    trace = Path(str(stopped.result))
    assert trace.parent == tmp_path / "traces"
    assert trace.name.startswith(f"trillm-engine-{client.ready.pid}-")
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
    assert any(name.startswith("aten::") for name in names)  # the forward ran in here


@pytest.mark.slow  # `make test`: the TP 2 executor's sleep (test_executor_multiproc), TP 1's above
@pytest.mark.timeout(240)
def test_sleep_reaches_every_rank_at_tp2(client_for: object) -> None:
    client = client_for(tensor_parallel_size=2)  # type: ignore[operator]
    assert cmdline(client.process.pid) == "trillm::engine"
    ranks = sorted(cmdline(pid) for pid in children(client.process.pid))
    assert ranks == ["trillm::worker_0", "trillm::worker_1"]
    client.add(1, PROMPT, 12)
    client.run_until(lambda: 1 in client.finish)
    for call_id, level in ((1, 1), (3, 2)):  # both levels, each woken up
        assert call(client, call_id, "sleep", level).ok
        assert call(client, call_id + 1, "wake_up").result == level
    client.add(2, PROMPT, 12)
    client.run_until(lambda: 2 in client.finish)
    assert client.tokens[2] == client.tokens[1]
