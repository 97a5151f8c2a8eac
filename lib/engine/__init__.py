"""Engine: the frontend's client and the engine process, split by the process they run in.

- `client/`: runs in the frontend (API-server) process: `open_llm`, `AsyncLLM`, output
  processing, detokenisation, the engine's launch and watchdog.
- `core/`: runs in the engine process: busy loop, scheduler, KV-cache manager, executors.
- `protocol/`: the wire both speak (message kinds, STEP record, config, `RemoteError`).

`core` and `client` never import each other (`tests/test_layering.py`). This package's names
are the frontend's public ones and the protocol's; the engine process's own names are
imported from `trillm.engine.core`, so that importing the client never loads the engine's
code, or torch. Knows no HTTP (DESIGN.md §1, §6, §8).
"""

from .client import AsyncLLM as AsyncLLM
from .client import EngineDeadError as EngineDeadError
from .client import EngineStartError as EngineStartError
from .client import LLMConfig as LLMConfig
from .client import Output as Output
from .client import PromptTooLongError as PromptTooLongError
from .client import RequestFailedError as RequestFailedError
from .client import RequestStream as RequestStream
from .client import SamplingParams as SamplingParams
from .client import SamplingParamsError as SamplingParamsError
from .client import StructuredOutputError as StructuredOutputError
from .client import StructuredOutputs as StructuredOutputs
from .client import TokenLogprob as TokenLogprob
from .client import open_llm as open_llm
from .protocol import EngineConfig as EngineConfig
from .protocol import EngineConfigError as EngineConfigError
from .protocol import FinishReason as FinishReason
from .protocol import RemoteError as RemoteError
from .protocol import StepView as StepView
