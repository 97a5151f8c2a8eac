"""The node token: the shared secret with which node agents join the node link.

Read at the command line's edge (`read_node_token`, `link_key`: a bad token is refused before
anything starts), handed to the engine process in its environment, and used by the link's
handshake (`engine.core.nodes._node_link`). Here, in what every process reads, because the
CLI that runs the API process checks it and must not load the engine's code to do so.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping
from typing import Final

NODE_TOKEN_ENV: Final = "TRILLM_NODE_TOKEN"
MIN_TOKEN_LENGTH: Final = 16
TOKEN_HINT: Final = (
    "give every node the same secret with --node-token-file FILE or the environment variable "
    f"{NODE_TOKEN_ENV} (e.g. `openssl rand -hex 32`)"
)


class NodeTokenError(ValueError):
    """The node token is missing, unreadable or too short; the message says what to give."""


def read_node_token(
    token: str | None, token_file: str | None, environ: Mapping[str, str]
) -> bytes | None:
    """The node token of `--node-token`, else `--node-token-file`, else `TRILLM_NODE_TOKEN`.

    Surrounding whitespace (a file's newline) is not part of it. For the command line's edge.

    Raises:
        NodeTokenError: both flags given, an unreadable or empty file, a token that is too
            short.
    """
    if token is not None and token_file is not None:
        raise NodeTokenError("give one of --node-token and --node-token-file, not both")
    where = "--node-token"
    if token_file is not None:
        where = f"--node-token-file {token_file}"
        try:
            with open(token_file, "rb") as file:
                mode = os.fstat(file.fileno()).st_mode
                value = file.read(4096)
        except OSError as exc:
            raise NodeTokenError(f"cannot read the node token: {where}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            print(
                f"trillm: warning: {token_file} (the node token) is readable by other users "
                f"(mode {stat.S_IMODE(mode):o}); `chmod 600 {token_file}`",
                file=sys.stderr,
                flush=True,
            )
        raw = value.strip()
    elif token is not None:
        raw = token.strip().encode()
    elif NODE_TOKEN_ENV in environ:
        where, raw = NODE_TOKEN_ENV, environ[NODE_TOKEN_ENV].strip().encode()
    else:
        return None
    if b"\0" in raw or not _is_utf8(raw):  # it travels in an environment variable
        raise NodeTokenError(
            f"the node token of {where} is not text (UTF-8 without NUL bytes): use a "
            "printable one, e.g. `openssl rand -hex 32`"
        )
    if len(raw) < MIN_TOKEN_LENGTH:
        raise NodeTokenError(
            f"the node token of {where} is {len(raw)} bytes; it must be at least "
            f"{MIN_TOKEN_LENGTH} (e.g. `openssl rand -hex 32`)"
        )
    return raw


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def link_key(nnodes: int, token: bytes | None, *, insecure: bool) -> bytes:
    """The MAC key of the node link: the token, or b"" with `--insecure-node-link`.

    Raises:
        NodeTokenError: several nodes and no token without the opt-out, or both at once.
    """
    if token is not None and insecure:
        raise NodeTokenError(
            f"--insecure-node-link with a node token ({NODE_TOKEN_ENV}, --node-token or "
            "--node-token-file): drop one of them"
        )
    if token is not None:
        return token
    if insecure or nnodes <= 1:
        return b""
    raise NodeTokenError(
        f"--nnodes {nnodes} needs a node token: the node link (--master-port + 1) carries "
        f"every prompt and would otherwise let anyone join as a node; {TOKEN_HINT}, or pass "
        "--insecure-node-link on a network only your nodes can reach"
    )


def node_token_from_environment(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The token the frontend handed the engine process in `TRILLM_NODE_TOKEN`.

    The engine's configuration travels on its command line, which every user can read
    (/proc/PID/cmdline); its environment only its own user can, so the one secret goes there.
    """
    value = environ.get(NODE_TOKEN_ENV)
    return None if value is None else value.strip().encode()


def without_node_token(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` for a worker rank, which has no use for the node token."""
    return {k: v for k, v in environ.items() if k != NODE_TOKEN_ENV}
