"""The engine process: busy loop, scheduler, KV-cache manager, executors (DESIGN.md §6).

Everything here runs in the engine process (and its worker processes at TP > 1). It speaks to
the frontend only through `..protocol` over the rings, and imports nothing from `..client`.
"""

from ._errors import WorkerDiedError as WorkerDiedError
from ._process import serve as serve
from .executor._executor import Executor as Executor
from .executor._executor import NullExecutor as NullExecutor
from .executor._executor import UniprocExecutor as UniprocExecutor
from .nodes._node_agent import NodeAgentError as NodeAgentError
from .nodes._node_agent import run_node_agent as run_node_agent
from .nodes._node_link import NODE_TOKEN_ENV as NODE_TOKEN_ENV
from .nodes._node_link import NodeTokenError as NodeTokenError
from .nodes._node_link import link_key as link_key
from .nodes._node_link import read_node_token as read_node_token
from .sched._request import Request as Request
from .sched._scheduler import Scheduler as Scheduler
from .sched._scheduler import SchedulerConfig as SchedulerConfig
from .sched._scheduler import StepResult as StepResult
