"""Device side: model runner, worker, paged attention, sampler, weight loaders.

Runs in the engine process at TP 1 and in one worker process per rank above it; the only
place torch lives. Each folder is a room (`worker`, `runner`, `layers`, `attention`, `models`,
`loader`, `quant`, `cpu`, `sample`, `spec_decode`, `lora`); `_step_batch` is the device
contract, at the door.

Knows no scheduling policy and nothing of the engine or HTTP (DESIGN.md §1, §7): it runs the
`StepBatch` the scheduler decided and returns a columnar `RunnerOutput`.
"""

from ..common.config import WorkerConfig as WorkerConfig
from ..common.config import WorkerConfigError as WorkerConfigError
from ..common.wire import KernelChoice as KernelChoice
from ..common.wire import SamplingOptions as SamplingOptions
from ._step_batch import NewRequest as NewRequest
from ._step_batch import PromptLogprobs as PromptLogprobs
from ._step_batch import RunnerOutput as RunnerOutput
from ._step_batch import RunnerOutputCodec as RunnerOutputCodec
from ._step_batch import StepBatch as StepBatch
from ._step_batch import StepBatchCodec as StepBatchCodec
from .cpu._cpu_linear import CpuFeatures as CpuFeatures
from .cpu._cpu_linear import CpuLinearUnsupportedError as CpuLinearUnsupportedError
from .cpu._cpu_linear import probe_cpu_features as probe_cpu_features
from .layers._parallel import TensorParallel as TensorParallel
from .layers._parallel import TensorParallelError as TensorParallelError
from .loader._gguf import GGUFCheckpoint as GGUFCheckpoint
from .loader._gguf import GGUFError as GGUFError
from .loader._weights import WeightsError as WeightsError
from .loader._weights import open_model as open_model
from .lora._lora_files import LoraAdapterError as LoraAdapterError
from .lora._lora_weights import read_adapter as read_adapter
from .models._model_config import ModelConfig as ModelConfig
from .models._model_config import ModelConfigError as ModelConfigError
from .runner._ahead import PendingOutput as PendingOutput
from .runner._ahead import ReadyOutput as ReadyOutput
from .runner._model_runner import ModelRunner as ModelRunner
from .sample._grammar_mask import step_bitmask as step_bitmask
from .worker import _worker_process as worker_process  # noqa: F401 - the workers' wire, for executors
from .worker._failure import InjectedFault as InjectedFault
from .worker._failure import WorkerFailure as WorkerFailure
from .worker._failure import raised_in as raised_in
from .worker._worker import KVCacheTooSmallError as KVCacheTooSmallError
from .worker._worker import Worker as Worker
