"""`trillm serve`'s flags, built from the declarations on the configs' fields (`flags.Flag`).

A flag is one field: `WorkerConfig`, `EngineConfig`, `LLMConfig`, `ServeConfig` and
`ServerConfig` declare theirs (`ServerConfig.options` gathers the server's), `ServeCommand`
below those that no config holds. `SERVE_LAYOUT` only orders them in `--help` (it is the
flags' public face, kept word for word: tests/data/serve_help.txt); a declared flag it does not
list comes last among the options.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..common.config import WorkerConfig
from ..common.flags import Option, flag, options_of


@dataclass(frozen=True)
class ServeCommand:
    """The flags `trillm serve` itself reads: what it resolves before any config exists (the
    served name from MODEL, the API key and the node token from a file or the environment,
    which configs must not carry: they travel on the engine's command line) or runs itself
    (the API server's supervisor, a node agent)."""

    served_model_name: str | None = field(
        default=None,
        metadata=flag("--served-model-name", help="the model name clients use (default: MODEL)"),
    )
    headless: bool = field(
        default=False,
        metadata=flag(
            "--headless",
            help="run only this node's worker ranks (no server, no engine): nodes with "
            "--node-rank > 0",
        ),
    )
    node_token_file: str | None = field(
        default=None,
        metadata=flag(
            "--node-token-file",
            metavar="FILE",
            help="a file holding the secret every node shares (e.g. `openssl rand -hex 32 > "
            "FILE; chmod 600 FILE`): a node joins the broadcast only by proving it (HMAC-SHA256 "
            "over a fresh challenge). Or set TRILLM_NODE_TOKEN. Required with --nnodes > 1 "
            "unless --insecure-node-link",
        ),
    )
    node_token: str | None = field(
        default=None,
        metadata=flag(
            "--node-token",
            metavar="TOKEN",
            help="the node token itself; visible to every user in `ps`: prefer "
            "--node-token-file or TRILLM_NODE_TOKEN",
        ),
    )
    api_key: str | None = field(
        default=None,
        metadata=flag(
            "--api-key",
            help="require 'Authorization: Bearer KEY' on every route but /health; visible to "
            "every user in `ps`: prefer --api-key-file or TRILLM_API_KEY",
        ),
    )
    api_key_file: str | None = field(
        default=None,
        metadata=flag(
            "--api-key-file",
            metavar="FILE",
            help="a file (mode 0600) whose first line is the API key; or set TRILLM_API_KEY",
        ),
    )
    max_api_restarts: int = field(
        default=3,
        metadata=flag(
            "--max-api-restarts",
            help="run the API server in a child process and start it again, at most this often "
            "within --api-restart-window, if it crashes (a signal, an uncaught exception; its "
            "open requests are lost); 0: no child, the API server runs in this process",
        ),
    )
    api_restart_window: float = field(
        default=300.0, metadata=flag("--api-restart-window", help="seconds")
    )
    no_engine_restart: bool = field(  # --max-engine-restarts 0, whatever it says
        default=False,
        metadata=flag(
            "--no-engine-restart",
            help="never start a dead engine again: answer 503 and exit after --engine-death-grace",
        ),
    )


NODES = (
    "multi-node tensor parallelism",
    "TP across --nnodes machines, TP / nnodes ranks each: node 0 runs the server, the engine "
    "and ranks 0..L-1; node k runs `trillm serve MODEL --headless --node-rank k` with the same "
    "flags. Collectives meet at --master-addr:--master-port (torch.distributed), the engine's "
    "broadcast at --master-port + 1. Both carry prompts and activations in clear: keep them on "
    "a private network or a tunnel (WireGuard, ssh -L; docs/deploy.md). Nodes join the "
    "broadcast only with a shared node token (--node-token-file or TRILLM_NODE_TOKEN).",
)
DEV = ("control endpoints (development; docs/debugging.md)", None)

# (group, or None for the options: its dests in --help's order). argparse's usage line follows
# the order flags are added in, across groups, so the groups interleave as they always did.
SERVE_LAYOUT: tuple[tuple[tuple[str, str | None] | None, str], ...] = (
    (
        None,
        """host port served_model_name dtype device cpu_linear cpu_decode quantization
        attention_backend enforce_eager tensor_parallel_size data_parallel_size""",
    ),
    (
        NODES,
        """nnodes node_rank master_addr master_port headless node_token_file node_token
        insecure_node_link distributed_timeout""",
    ),
    (
        None,
        """max_model_len max_num_seqs max_num_batched_tokens max_prefill_tokens_per_decode
        block_size async_scheduling
        enable_prefix_caching load_format gpu_memory_utilization kv_cache_memory_bytes seed
        api_key api_key_file max_queued_requests max_prompts_per_request
        request_body_timeout shutdown_timeout write_timeout stream_interval
        engine_death_grace max_engine_restarts engine_restart_window max_api_restarts
        api_restart_window engine_restart_wait engine_in_process no_engine_restart
        keep_alive_on_engine_death engine_watchdog_timeout structured_outputs_timeout
        structured_outputs_max_depth structured_outputs_max_bytes
        structured_outputs_max_regex_optionals enable_auto_tool_choice
        enable_prompt_tokens_details responses_store_size tool_call_parser reasoning_parser
        chat_template pooler_config enable_prompt_embeds
        enable_lora lora_modules max_loras max_lora_rank max_cpu_loras
        enable_runtime_lora_updating enable_tokenizer_info_endpoint
        inject_fault executor null_step_time""",
    ),
    (DEV, "enable_dev_endpoints profiler_dir"),
)


def serve_options() -> dict[str, Option]:
    """Every declared `trillm serve` flag, by dest."""
    from ..http import ServerConfig  # the API process's stack (hypercorn, trio, tokenizers)

    options = [*options_of(ServeCommand), *options_of(WorkerConfig), *ServerConfig.options()]
    return {o.flag.dest: o for o in options}


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """Add every declared flag to `serve`, in `SERVE_LAYOUT`'s order and groups."""
    # MODEL is the one positional, and no config's: the CLI resolves its default.
    serve.add_argument("model", nargs="?", help="model directory or .gguf file")
    options = serve_options()
    for group, dests in SERVE_LAYOUT:  # each group once: argparse lists them as created
        target = serve if group is None else serve.add_argument_group(*group)
        _add(target, (options.pop(dest) for dest in dests.split()))
    _add(serve, options.values())  # declared, not in the layout yet


def _with_message(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, its ValueError's message shown by argparse (which otherwise prints only
    "invalid value")."""

    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parsed


def _add(group: Any, options: Iterable[Option]) -> None:
    for option in options:
        declared = option.flag
        kwargs: dict[str, Any] = {
            "help": argparse.SUPPRESS if declared.hidden else declared.help,
            "default": option.default,
        }
        if declared.many:  # one or more values, the flag repeatable
            kwargs.update(nargs="+", action="extend", default=list(option.default))
            if declared.parse is not None:
                kwargs["type"] = _with_message(declared.parse)
        elif option.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if option.default else "store_true"
        elif option.kind is not str:
            kwargs["type"] = option.kind
        if declared.choices is not None:
            kwargs["choices"] = list(declared.choices)
        if declared.metavar is not None:
            kwargs["metavar"] = declared.metavar
        group.add_argument(*declared.names, **kwargs)
