"""OpenAI-compatible HTTP face over the engine's `AsyncLLM` (DESIGN.md §9).

The names the command line runs the server by. Importing this package loads the API process's
whole stack (hypercorn, trio, the engine client, transformers' tokenizer classes) and never
torch, triton, `trillm.gpu` or the engine's own code (`tests/test_layering.py` checks it in a
fresh interpreter).
"""

from .server._api_key import read_api_key as read_api_key
from .server._server import ServerConfig as ServerConfig
from .server._server import build_config as build_config
from .server._server import run_server as run_server
