"""The wire the frontend and the engine process speak (DESIGN.md §4): message kinds and codecs,
the STEP record, the engine's configuration and command line, and the root cause of a death.

Both `..client` and `..core` import this; it imports neither.
"""

from ._config import EngineConfig as EngineConfig
from ._config import EngineConfigError as EngineConfigError
from ._errors import RemoteError as RemoteError
from ._step_record import FinishReason as FinishReason
from ._step_record import StepView as StepView
