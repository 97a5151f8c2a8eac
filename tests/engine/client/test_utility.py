"""`AsyncLLM.utility`: the allow-list is checked in the frontend, arguments reach the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from trillm.engine import EngineConfig, LLMConfig, open_llm
from trillm.gpu import WorkerConfig

from ...gpu.conftest import save_tiny

pytestmark = pytest.mark.timeout(120)


async def test_unknown_methods_never_reach_the_engine_and_args_do(tmp_path: Path) -> None:
    worker = WorkerConfig(str(save_tiny(tmp_path, "llama")), device="cpu")
    config = LLMConfig(EngineConfig(worker=worker, executor="null"), start_timeout=60)
    async with open_llm(config) as llm:
        with trio.fail_after(30):
            with pytest.raises(ValueError, match=r"^unknown utility method 'drop_caches': one of "):
                await llm.utility("drop_caches")
            assert await llm.utility("ping") == "pong"  # the ring is in step: nothing was sent
            with pytest.raises(ValueError, match=r"^sleep level must be 1 or 2, got 7$"):
                await llm.utility("sleep", args=[7])
            assert await llm.utility("sleep", args=[2]) == 0  # nothing in flight to abort
            assert await llm.utility("is_sleeping") == 2
            assert await llm.utility("wake_up") == 2
            assert await llm.utility("is_sleeping") == 0
