"""`open_llm`: an `AsyncLLM`'s life, from its engines' start to their shutdown, under trio.

Apart from `AsyncLLM` because it is the one place that owns the nursery of the engines'
tasks and the LoRA files' directory (`lora_cache`): whatever ends the block (the caller's
error, an engine's start-up failure, cancellation) shuts the engines down first, and a
single error comes out as itself, not wrapped in a group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import msgspec
import trio

from ._async_llm import AsyncLLM
from ._config import LLMConfig


@asynccontextmanager
async def open_llm(config: LLMConfig) -> AsyncIterator[AsyncLLM]:
    """Start the engine process and yield an `AsyncLLM`; on exit shut the engine down.

    Raises:
        EngineStartError: the engine failed before READY (bad model path, out of memory...),
            with its own message.
    """
    with lora_cache(config) as config:
        async with _open_llm(config) as llm:
            yield llm


@contextlib.contextmanager
def lora_cache(config: LLMConfig) -> Iterator[LLMConfig]:
    """`config` with a private directory (0700) for the checked copies of the LoRA
    adapters' files (`WorkerConfig.lora_cache_dir`), removed at exit; owned here, not by an
    engine, so a restarted engine reads the bytes checked before."""
    worker = config.engine.worker
    if not worker.enable_lora or worker.lora_cache_dir:
        yield config
        return
    with tempfile.TemporaryDirectory(prefix="trillm-lora-") as directory:
        worker = dataclasses.replace(worker, lora_cache_dir=directory)
        engine = msgspec.structs.replace(config.engine, worker=worker)
        yield dataclasses.replace(config, engine=engine)


@asynccontextmanager
async def _open_llm(config: LLMConfig) -> AsyncIterator[AsyncLLM]:
    llm = AsyncLLM(config)
    try:
        async with trio.open_nursery() as nursery:
            try:
                await llm._start(nursery)
                yield llm
            finally:
                with trio.CancelScope(shield=True):
                    await llm.engines.shutdown()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # one error (ours or the caller's): raise it as is
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from group.exceptions[0].__cause__
        raise
