"""The HTTP layer's settings (`ServeConfig`): one frozen record, built once from the flags.

`server._server` builds it and the app passes it down, so nothing below the edge reads a flag
or the environment (the engine's settings are in `LLMConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._offload import default_threads

MAX_HEADER_BYTES = 16 << 10  # request line and headers, however they arrive (h11, h2, h2c)


@dataclass(frozen=True)
class ServeConfig:
    """The HTTP layer's settings (the engine's are in `LLMConfig`)."""

    served_model_name: str
    api_key: str | None = None
    max_queued_requests: int = 1024  # completions (prompts x n) admitted and not finished
    max_prompts_per_request: int = 1024  # prompts x n in one request
    max_body_bytes: int = 4 << 20
    max_header_bytes: int = MAX_HEADER_BYTES
    request_body_timeout: float | None = 30.0  # seconds for a body to arrive (None: no limit)
    tokenizer_threads: int = field(default_factory=default_threads)
    write_timeout: float = 30.0
    # tool_choice "auto", and no tool_choice with tools (OpenAI's default then): on, as in
    # SGLang and llama.cpp; off (vLLM's default) refuses such requests with a 400.
    enable_auto_tool_choice: bool = True
    tool_call_parser: str = "hermes"  # the tool-call format (the only one: Hermes)
    stream_interval: int = 1  # tokens per streamed chunk, at least (the last may have fewer)
    enable_dev_endpoints: bool = False  # the control routes of `_dev_endpoints`
    profiler_dir: str | None = None  # where /start_profile's traces go
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    responses_store_size: int = 1024  # responses kept for GET and previous_response_id (LRU)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's environment variable
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING, as a flag).
    enable_runtime_lora_updating: bool = False
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (vLLM's flag)
