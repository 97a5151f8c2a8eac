"""The Responses API's fields this server defines no behaviour for: each a 400 naming it."""

from __future__ import annotations

from typing import Any

from ..edge._errors import RequestError

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Reasoning comes back as plain content (never encrypted), which serves the same end.
SERVED_INCLUDES = frozenset({"reasoning.encrypted_content", LOGPROBS_INCLUDE})


def refuse_unserved(request: Any, reasoning_parser: str | None) -> None:
    """A 400 for each field this server defines no behaviour for, naming it.

    Raises:
        RequestError: 400 with `param` the field.
    """
    unserved = {
        "conversation": request.conversation,
        "prompt": request.prompt,
        "max_tool_calls": request.max_tool_calls,
    }
    for name, value in unserved.items():
        if value is not None:  # max_tool_calls 0 means no calls: refused too, never ignored
            raise RequestError(400, f"{name} is not supported by this server", param=name)
    if request.truncation not in (None, "disabled"):
        raise RequestError(
            400,
            f"truncation {request.truncation!r} is not supported: trillm never drops input; send "
            f"'disabled' and a shorter input",
            param="truncation",
        )
    if request.service_tier not in (None, "auto", "default"):
        raise RequestError(
            400, f"service_tier {request.service_tier!r} is not served here", param="service_tier"
        )
    for i, include in enumerate(request.include or ()):
        if include not in SERVED_INCLUDES:
            raise RequestError(
                400,
                f"include {include!r} is not supported: this server serves "
                f"{sorted(SERVED_INCLUDES)}",
                param=f"include[{i}]",
            )
    if request.stream_options is not None and request.stream_options.include_obfuscation:
        raise RequestError(
            400,
            "stream_options.include_obfuscation is not supported: send false",
            param="stream_options.include_obfuscation",
        )
    if request.stream_options is not None and not request.stream:
        raise RequestError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    if request.text is not None and request.text.verbosity not in (None, "medium"):
        raise RequestError(
            400,
            f"text.verbosity {request.text.verbosity!r} is not supported (the model's own "
            f"length is 'medium')",
            param="text.verbosity",
        )
    reasoning = request.reasoning
    if reasoning is not None:
        if reasoning_parser is None:
            raise RequestError(
                400,
                "reasoning needs a reasoning model: this server runs no --reasoning-parser",
                param="reasoning",
            )
        for name in ("summary", "generate_summary"):
            value = getattr(reasoning, name)
            if value not in (None, "auto"):
                raise RequestError(
                    400,
                    f"reasoning.{name} {value!r} is not supported: trillm returns the reasoning "
                    f"text itself (send 'auto' or leave it out)",
                    param=f"reasoning.{name}",
                )
    if request.input is None:
        raise RequestError(400, "input is required", param="input")
