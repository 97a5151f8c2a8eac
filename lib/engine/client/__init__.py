"""The frontend's engine client: `open_llm`, `AsyncLLM`, streams, detokenisation (DESIGN.md §8),
and `LLM`, the synchronous offline API on the same engine process and rings.

Everything here runs in the API-server process. It starts the engine process by its entry
point name and speaks to it only through `..protocol`; it imports nothing from `..core`.
"""

from ...common.wire import PoolingType as PoolingType
from ..protocol import EngineConfig as EngineConfig
from ..protocol import EngineConfigError as EngineConfigError
from ..protocol import FinishReason as FinishReason
from ..protocol import RemoteError as RemoteError
from ._async_llm import AsyncLLM as AsyncLLM
from ._config import LLMConfig as LLMConfig
from ._errors import ChatTemplateError as ChatTemplateError
from ._errors import DataParallelRankError as DataParallelRankError
from ._errors import EngineDeadError as EngineDeadError
from ._errors import EngineRestartingError as EngineRestartingError
from ._errors import InvalidPromptError as InvalidPromptError
from ._errors import PinnedEngineDeadError as PinnedEngineDeadError
from ._errors import PromptTooLongError as PromptTooLongError
from ._errors import RequestFailedError as RequestFailedError
from ._llm import LLM as LLM
from ._open_llm import open_llm as open_llm
from .engines._launch import EngineStartError as EngineStartError
from .engines._restarts import RestartPolicy as RestartPolicy
from .inputs._grammar_budget import MAX_STRUCTURED_DEPTH as MAX_STRUCTURED_DEPTH
from .inputs._grammar_budget import GrammarBudget as GrammarBudget
from .inputs._lora import LoraAdapterExistsError as LoraAdapterExistsError
from .inputs._lora import LoraNotFoundError as LoraNotFoundError
from .inputs._prepared import PreparedRequest as PreparedRequest
from .inputs._prompt_embeds import PromptEmbeds as PromptEmbeds
from .inputs._prompt_embeds import PromptEmbedsError as PromptEmbedsError
from .inputs._regex_size import MAX_REGEX_OPTIONALS as MAX_REGEX_OPTIONALS
from .inputs._sampling_params import MAX_LOGIT_BIAS as MAX_LOGIT_BIAS
from .inputs._sampling_params import SamplingParams as SamplingParams
from .inputs._sampling_params import SamplingParamsError as SamplingParamsError
from .inputs._structured import JSON_OPTIONS as JSON_OPTIONS
from .inputs._structured import MAX_GRAMMAR_BYTES as MAX_GRAMMAR_BYTES
from .inputs._structured import REASONING_PARSERS as REASONING_PARSERS
from .inputs._structured import StructuredOutputError as StructuredOutputError
from .inputs._structured import StructuredOutputs as StructuredOutputs
from .outputs._outputs import Output as Output
from .outputs._outputs import TokenLogprob as TokenLogprob
from .outputs._pooling import PoolerConfig as PoolerConfig
from .outputs._pooling import PoolerConfigError as PoolerConfigError
from .outputs._pooling import PoolingOutput as PoolingOutput
from .outputs._pooling import finish_embedding as finish_embedding
from .outputs._pooling import load_pooler_config as load_pooler_config
from .outputs._request_output import CompletionOutput as CompletionOutput
from .outputs._request_output import EmbeddingOutput as EmbeddingOutput
from .outputs._request_output import EmbeddingRequestOutput as EmbeddingRequestOutput
from .outputs._request_output import Logprob as Logprob
from .outputs._request_output import RequestOutput as RequestOutput
from .outputs._streams import RequestStream as RequestStream
from .outputs._token_pieces import TokenIds as TokenIds
from .outputs._token_pieces import TokenPieces as TokenPieces
