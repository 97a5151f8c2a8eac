"""Device side: model runner, worker, paged attention, sampler, weight loaders.

Knows no scheduling policy and nothing of the engine or HTTP (DESIGN.md §1, §7): it runs the
`StepBatch` the scheduler decided and returns a columnar `RunnerOutput`.
"""

from ..config import WorkerConfig as WorkerConfig
from ..config import WorkerConfigError as WorkerConfigError
from ..wire import KernelChoice as KernelChoice
from ..wire import SamplingOptions as SamplingOptions
from . import _worker_process as worker_process  # noqa: F401 - the workers' wire, for executors
from ._ahead import PendingOutput as PendingOutput
from ._ahead import ReadyOutput as ReadyOutput
from ._cpu_linear import CpuFeatures as CpuFeatures
from ._cpu_linear import CpuLinearUnsupportedError as CpuLinearUnsupportedError
from ._cpu_linear import probe_cpu_features as probe_cpu_features
from ._failure import InjectedFault as InjectedFault
from ._failure import WorkerFailure as WorkerFailure
from ._failure import raised_in as raised_in
from ._gguf import GGUFCheckpoint as GGUFCheckpoint
from ._gguf import GGUFError as GGUFError
from ._grammar_mask import step_bitmask as step_bitmask
from ._lora_files import LoraAdapterError as LoraAdapterError
from ._lora_weights import read_adapter as read_adapter
from ._model_config import ModelConfig as ModelConfig
from ._model_config import ModelConfigError as ModelConfigError
from ._model_runner import ModelRunner as ModelRunner
from ._parallel import TensorParallel as TensorParallel
from ._parallel import TensorParallelError as TensorParallelError
from ._step_batch import NewRequest as NewRequest
from ._step_batch import PromptLogprobs as PromptLogprobs
from ._step_batch import RunnerOutput as RunnerOutput
from ._step_batch import RunnerOutputCodec as RunnerOutputCodec
from ._step_batch import StepBatch as StepBatch
from ._step_batch import StepBatchCodec as StepBatchCodec
from ._weights import WeightsError as WeightsError
from ._weights import open_model as open_model
from ._worker import KVCacheTooSmallError as KVCacheTooSmallError
from ._worker import Worker as Worker
