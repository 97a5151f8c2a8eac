"""OpenAI-compatible HTTP face over the engine's `AsyncLLM` (DESIGN.md §9).

The names the command line runs the server by. Importing this package loads the API process's
whole stack (hypercorn, trio, the engine client, transformers' tokenizer classes) and never
torch, triton, `trillm.gpu` or the engine's own code (`tests/test_layering.py` checks it in a
fresh interpreter).
"""

from ._api_key import read_api_key as read_api_key
from ._server import ServerConfig as ServerConfig
from ._server import build_config as build_config
from ._server import run_server as run_server
from ._supervisor import supervise as supervise
