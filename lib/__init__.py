"""trillm: an LLM inference server on trio and shared-memory rings.

The client API is re-exported here lazily (`trillm.open_llm`, `trillm.SamplingParams`, ...),
so that importing a subpackage (the transport, in a worker) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "open_llm": "trillm.engine.client._open_llm",
    "AsyncLLM": "trillm.engine.client._async_llm",
    "LLM": "trillm.engine.client._llm",
    "RequestOutput": "trillm.engine.client.outputs._request_output",
    "CompletionOutput": "trillm.engine.client.outputs._request_output",
    "EmbeddingRequestOutput": "trillm.engine.client.outputs._request_output",
    "LLMConfig": "trillm.engine.client._config",
    "PromptTooLongError": "trillm.engine.client._errors",
    "SamplingParams": "trillm.engine.client.inputs._sampling_params",
    "SamplingParamsError": "trillm.engine.client.inputs._sampling_params",
    "StructuredOutputs": "trillm.engine.client.inputs._structured",
    "StructuredOutputError": "trillm.engine.client.inputs._structured",
    "EngineConfig": "trillm.engine.protocol._config",
    "EngineDeadError": "trillm.engine.client._errors",
    "EngineStartError": "trillm.engine.client.engines._launch",
    "WorkerConfig": "trillm.common.config",
    "default_model_dir": "trillm.default_model",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trillm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
