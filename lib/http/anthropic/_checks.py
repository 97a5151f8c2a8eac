"""The Messages API's requests checked before they are translated: what the server cannot do is
a 400 naming the field, never ignored (see `_api`'s docstring for the list), and thinking is
refused on a server whose turns are not split into reasoning and text.

Apart from the translation (`_api`) because they read Anthropic's fields only, and each answer
is Anthropic's name for the field, whatever chat calls it.
"""

from __future__ import annotations

from ..edge._errors import RequestError
from ._schema import Block, Conversation, CountTokensRequest, MessagesRequest

MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
# Fields Anthropic defines for what this server does not have: a value (not null, not empty)
# is a 400.
REFUSED = {
    "container": "no code-execution containers run here",
    "mcp_servers": "this server connects to no MCP servers: offer their tools as custom tools",
    "context_management": "nothing edits the context here: trim the messages yourself",
    "diagnostics": "no prompt-cache diagnostics are kept",
    "inference_geo": "inference runs where this server runs",
}
ALLOWED = {"speed": (None, "standard"), "service_tier": (None, "auto", "standard_only")}


def check_thinking(
    request: MessagesRequest | CountTokensRequest, reasoning_parser: str | None
) -> None:
    """Refuse thinking on a server whose turns are not split into reasoning and text.

    `adaptive` thinking passes: the model decides whether to think, and a turn without
    thinking blocks is one of its answers.

    Raises:
        RequestError: 400 (param `thinking`) when thinking is `enabled` and
            `reasoning_parser` is None.
    """
    thinking = request.thinking
    if thinking is None or thinking.type != "enabled" or reasoning_parser is not None:
        return
    raise RequestError(
        400,
        f"thinking is {thinking.type!r} but this server runs no reasoning parser, so it has no "
        f'thinking to show: leave thinking out or send {{"type": "disabled"}} (or start the '
        f"server with --reasoning-parser)",
        param="thinking",
    )


def bad(param: str, message: str) -> RequestError:
    return RequestError(400, f"{param}: {message}", param=param)


def unsupported_block(block: Block, where: str, allowed: str) -> RequestError:
    return bad(
        f"{where}.type",
        f"blocks of type {block.type!r} are not supported here (the model reads text): send "
        f"{allowed} blocks",
    )


def refuse_unsupported(request: Conversation) -> None:
    for name, why in REFUSED.items():
        if getattr(request, name):
            raise bad(name, f"not supported ({why}); leave it out")
    for name, allowed in ALLOWED.items():
        value = getattr(request, name)
        if value not in allowed:
            others = ", ".join(repr(a) for a in allowed if a is not None)
            raise bad(name, f"{value!r} is not offered here; send {others} or leave it out")
    config = request.output_config
    if config is not None and config.effort is not None:
        raise bad("output_config.effort", "not supported (the model has one effort); leave it out")


def check_thinking_config(request: MessagesRequest | CountTokensRequest) -> None:
    thinking = request.thinking
    if thinking is None:
        return
    if thinking.type not in ("enabled", "adaptive", "disabled"):
        raise bad(
            "thinking.type", f"must be 'enabled', 'adaptive' or 'disabled', got {thinking.type!r}"
        )
    if thinking.display == "omitted":
        raise bad("thinking.display", "'omitted' is not supported (thinking is shown as it is)")
    if thinking.type != "enabled":
        return
    budget = thinking.budget_tokens
    if budget is None:
        raise bad("thinking.budget_tokens", "required when thinking.type is 'enabled'")
    if budget < MIN_THINKING_BUDGET:
        raise bad("thinking.budget_tokens", f"must be >= {MIN_THINKING_BUDGET}, got {budget}")
    max_tokens = getattr(request, "max_tokens", None)
    if max_tokens is not None and budget >= max_tokens:
        raise bad("thinking.budget_tokens", f"must be < max_tokens ({max_tokens}), got {budget}")
