"""The `trillm` parent process: the command, its flags, the API supervisor, the default model.

Runs in the `trillm serve` process itself, before any server exists and around it: it parses
and checks the flags, then either serves in this process (`--max-api-restarts 0`) or forks the
API server as a child it restarts (`_supervisor`). It never runs trio itself; nothing in
trillm imports it (`tests/test_layering.py`), and it may import every other package.
"""

from ._command import build_parser as build_parser
from ._command import main as main
from ._command import serve_config as serve_config
