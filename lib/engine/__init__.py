"""Engine: scheduler, KV-cache manager, busy loop, executors and the engine process.

Knows no HTTP (DESIGN.md §1, §6). The frontend client (`AsyncLLM`) lands with the frontend
issue; until then `_launch` starts the engine process and tests drive it through its rings.
"""

from ._config import EngineConfig as EngineConfig
from ._config import EngineConfigError as EngineConfigError
from ._errors import RemoteError as RemoteError
from ._errors import WorkerDiedError as WorkerDiedError
from ._executor import Executor as Executor
from ._executor import NullExecutor as NullExecutor
from ._executor import UniprocExecutor as UniprocExecutor
from ._launch import EngineStartError as EngineStartError
from ._request import FinishReason as FinishReason
from ._request import Request as Request
from ._scheduler import Scheduler as Scheduler
from ._scheduler import SchedulerConfig as SchedulerConfig
from ._scheduler import StepResult as StepResult
from ._step_record import StepView as StepView
