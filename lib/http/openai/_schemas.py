"""The HTTP layer's schemas in one namespace: requests, responses and the stream chunker."""

from ._bodies import *  # noqa: F403
from ._bodies import SSE_DONE as SSE_DONE
from ._chat_bodies import *  # noqa: F403
from ._completion_bodies import *  # noqa: F403
from ._info_responses import *  # noqa: F403
from ._request_params import to_sampling_params as to_sampling_params
from ._requests import *  # noqa: F403
from ._stream_chunker import StreamChunker as StreamChunker
