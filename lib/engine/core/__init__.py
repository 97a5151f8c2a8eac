"""The engine process: busy loop, scheduler, KV-cache manager, executors (DESIGN.md §6).

Everything here runs in the engine process (and its worker processes at TP > 1). It speaks to
the frontend only through `..protocol` over the rings, and imports nothing from `..client`.
"""

from ._errors import WorkerDiedError as WorkerDiedError
from ._executor import Executor as Executor
from ._executor import NullExecutor as NullExecutor
from ._executor import UniprocExecutor as UniprocExecutor
from ._node_agent import NodeAgentError as NodeAgentError
from ._node_agent import run_node_agent as run_node_agent
from ._node_link import NODE_TOKEN_ENV as NODE_TOKEN_ENV
from ._node_link import NodeTokenError as NodeTokenError
from ._node_link import link_key as link_key
from ._node_link import read_node_token as read_node_token
from ._process import serve as serve
from ._request import Request as Request
from ._scheduler import Scheduler as Scheduler
from ._scheduler import SchedulerConfig as SchedulerConfig
from ._scheduler import StepResult as StepResult
