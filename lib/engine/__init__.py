"""Engine: scheduler, KV-cache manager, busy loop, executors, the engine process, and the
trio frontend client (`open_llm`, `AsyncLLM`). Knows no HTTP (DESIGN.md §1, §6, §8).
"""

from ._async_llm import AsyncLLM as AsyncLLM
from ._async_llm import open_llm as open_llm
from ._config import EngineConfig as EngineConfig
from ._config import EngineConfigError as EngineConfigError
from ._config import LLMConfig as LLMConfig
from ._errors import EngineDeadError as EngineDeadError
from ._errors import PromptTooLongError as PromptTooLongError
from ._errors import RemoteError as RemoteError
from ._errors import WorkerDiedError as WorkerDiedError
from ._executor import Executor as Executor
from ._executor import NullExecutor as NullExecutor
from ._executor import UniprocExecutor as UniprocExecutor
from ._launch import EngineStartError as EngineStartError
from ._outputs import Output as Output
from ._outputs import TokenLogprob as TokenLogprob
from ._request import FinishReason as FinishReason
from ._request import Request as Request
from ._sampling_params import SamplingParams as SamplingParams
from ._sampling_params import SamplingParamsError as SamplingParamsError
from ._scheduler import Scheduler as Scheduler
from ._scheduler import SchedulerConfig as SchedulerConfig
from ._scheduler import StepResult as StepResult
from ._step_record import StepView as StepView
from ._streams import RequestStream as RequestStream
