"""The ASGI application: OpenAI routes over `AsyncLLM`, no framework in between.

Every request: check the header block's size (431), the API key (401, before routing, so
that no route can be found without it), route, read the body up to a limit (413 before
buffering more) and a deadline (408), decode into a msgspec schema (large bodies off the
loop), admit by work (429), run. Generation handlers watch `receive()` for the client's
disconnect and cancel their stream, which aborts the request in the engine. Errors are
OpenAI error objects; engine death becomes a 503 (or an error event in a stream). The faces'
handlers live with their face (`openai/_routes`, `responses/_routes`, `anthropic/_routes`)
and take the app's steps as `_steps.Edge`; this table names them.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import msgspec.structs
import trio

from ... import __version__
from ...engine.client import AsyncLLM, EngineDeadError
from ..anthropic._api import MessagesAPI, anthropic_error_body
from ..anthropic._routes import MessagesRoutes
from ..extras._chat_batch import ChatBatch
from ..extras._dev_endpoints import DevEndpoints
from ..extras._invocations import invocation_route, replayed
from ..extras._lora_routes import LoraRoutes
from ..extras._tokenize_api import TokenizeAPI
from ..metrics._metrics import Metrics
from ..openai._models_api import PREFIX as MODELS_PREFIX
from ..openai._models_api import ModelsAPI
from ..openai._routes import CompletionRoutes
from ..openai._schemas import decode_request, version_response
from ..pooling._api import PoolingAPI
from ..responses._api import ResponsesAPI
from ..responses._routes import ITEM_PREFIX, ResponsesRoutes
from ..responses._store import ResponseStore
from ..turn._generate import Generation
from ._admission import Admission, Held
from ._config import ServeConfig
from ._errors import (
    RequestError,
    error_body,
    http_error,
    internal_error,
    not_found,
    overloaded,
    too_large,
    unauthorized,
)
from ._rank import pinned_rank
from ._steps import Edge, Receive, Scope, Send, header


class ClientDisconnected(Exception):
    """The client went away before its request was read; nothing is left to answer."""


log = logging.getLogger("trillm.http")
JSON = [(b"content-type", b"application/json")]
S = TypeVar("S")
OPEN_ROUTES = frozenset({"/health"})  # answered without the API key (routers probe it)
ANTHROPIC_PREFIX = "/v1/messages"  # Anthropic's routes answer errors in Anthropic's shape
DECODE_INLINE_BYTES = 32 << 10  # a smaller body decodes on the loop (under 0.5 ms)


class App:
    """The OpenAI-compatible ASGI app."""

    def __init__(self, llm: AsyncLLM, config: ServeConfig, metrics: Metrics) -> None:
        self.llm = llm
        self.config = config
        self.metrics = metrics
        self.generation = Generation(llm, config, metrics)
        self.admission = Admission(
            max_queued=config.max_queued_requests, max_per_request=config.max_prompts_per_request
        )
        self.models = ModelsAPI(
            llm, config.served_model_name, dev=config.enable_dev_endpoints, respond=self._respond
        )
        edge = Edge(self._open, self._rank, self._respond)
        self.responses = ResponsesAPI(self.generation, ResponseStore(config.responses_store_size))
        self.messages = MessagesAPI(self.generation)
        completions = CompletionRoutes(edge, self.generation)
        responses = ResponsesRoutes(edge, self.responses)
        messages = MessagesRoutes(edge, self.messages)
        self._routes: dict[tuple[str, str], Callable[..., Awaitable[None]]] = {
            ("GET", "/health"): self._health,
            ("GET", "/version"): self._version,
            ("GET", "/v1/models"): self.models.list_models,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/v1/completions"): completions.completions,
            ("POST", "/v1/chat/completions"): completions.chat,
            ("POST", "/v1/responses"): responses.create,
            ("POST", "/v1/messages"): messages.create,
            ("POST", "/v1/messages/count_tokens"): messages.count_tokens,
            ("POST", "/invocations"): self._invocations,
        }
        batch = ChatBatch(
            completions.chat,
            self._read_body,
            self._respond,
            max_conversations=config.max_prompts_per_request,
        )
        self._routes[("POST", "/v1/chat/completions/batch")] = batch.handle
        self._item_routes = {
            "GET": responses.get,
            "DELETE": responses.delete,
            "POST": responses.cancel,  # /v1/responses/{id}/cancel
        }
        pooling = PoolingAPI(edge, self.generation, config.served_model_name)
        self._routes.update(pooling.routes())
        tokenize = TokenizeAPI(edge, self.generation, info=config.enable_tokenizer_info_endpoint)
        self._routes.update(tokenize.routes())
        if config.enable_runtime_lora_updating:
            lora = LoraRoutes(
                llm, config.served_model_name, self._read_body, self._decode, self._respond
            )
            self._routes.update(lora.routes())
        self.dev: DevEndpoints | None = None
        if config.enable_dev_endpoints:
            self.dev = DevEndpoints(llm, config.profiler_dir)
            self._routes.update(self.dev.routes())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        extra = _request_id_header(scope)
        try:
            self._check_header_size(scope)
            handler = self._route(scope)
            await handler(scope, receive, send, extra)
        except ClientDisconnected:
            return
        except Exception as exc:
            err = http_error(exc)
            if err is None:
                log.exception("internal error")
                err = internal_error(exc)
            headers = [(k.encode(), v.encode()) for k, v in err.headers.items()]
            if err.status in (408, 431) and scope.get("http_version", "1.1").startswith("1"):
                headers.append((b"connection", b"close"))  # HTTP/2 forbids the header
            anthropic = scope["path"].startswith(ANTHROPIC_PREFIX)
            body = anthropic_error_body(err) if anthropic else error_body(err)
            await self._respond(send, err.status, body, extra + headers)

    def _check_header_size(self, scope: Scope) -> None:
        """431 for a header block over the limit. hypercorn's own limits hold only for a block
        that arrives in pieces (h11 counts what is still incomplete; h2 applies its list size
        once the client acknowledged the setting): a 60 KB block in one write passed them."""
        size = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
        size += sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
        limit = self.config.max_header_bytes
        if size > limit:
            raise RequestError(
                431,
                f"the request line and headers take {size} bytes, more than the limit of "
                f"{limit}; send fewer or shorter headers",
                code="header_too_large",
            )

    def _route(self, scope: Scope) -> Callable[..., Awaitable[None]]:
        method, path = scope["method"], scope["path"]
        # The key first: without it every path but the open ones is a 401, so a client
        # without the key cannot tell a route from a 404 or a 405.
        if path not in OPEN_ROUTES and self.config.api_key is not None:
            key = self.config.api_key.encode()
            # Constant time: the time taken must not tell a guesser how much of a key was right.
            # Anthropic's clients send the key as x-api-key, OpenAI's as a bearer token.
            bearer = hmac.compare_digest(header(scope, b"authorization") or b"", b"Bearer " + key)
            anthropic = hmac.compare_digest(header(scope, b"x-api-key") or b"", key)
            if not (bearer or anthropic):
                raise unauthorized()
        handler = self._routes.get((method, path))
        if handler is None and path.startswith(ITEM_PREFIX):  # /v1/responses/{id}
            handler = self._item_routes.get(method)
        model_item = path.startswith(MODELS_PREFIX)  # /v1/models/{model}
        if handler is None and model_item and method == "GET":
            handler = self.models.retrieve
        if handler is None:
            if (
                any(p == path for _, p in self._routes)
                or path.startswith(ITEM_PREFIX)
                or model_item
            ):
                raise RequestError(405, f"method {method} is not allowed on {path}")
            raise not_found(f"route {path}")
        return handler

    async def _respond(
        self, send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        # Writes need no timeout here: the connection bounds them (`_connections.BoundedStream`).
        await send(
            {"type": "http.response.start", "status": status, "headers": JSON + (headers or [])}
        )
        await send({"type": "http.response.body", "body": body})

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.config.max_body_bytes
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(limit)
        chunks, total = [], 0
        timeout = self.config.request_body_timeout
        # A slow body holds a connection and its buffer: it has this long, all of it.
        with trio.move_on_after(timeout if timeout is not None else math.inf):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnected
                body = message.get("body", b"")
                total += len(body)
                if total > limit:
                    raise too_large(limit)
                chunks.append(body)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        raise RequestError(
            408,
            f"the request body did not arrive within {timeout:g} s (--request-body-timeout; "
            f"{total} bytes came); send the whole body at once",
            code="request_timeout",
        )

    async def _decode(self, body: bytes, kind: type[S]) -> S:
        """`body` decoded as `kind` (a large one on a worker thread)."""
        size = len(body) * 512 // DECODE_INLINE_BYTES  # in the offload's units
        return await self.generation.inputs.offload.run(size, decode_request, body, kind)

    # -- routes --------------------------------------------------------------------------

    async def _health(self, scope: Scope, receive: Receive, send: Send, extra: list[Any]) -> None:
        ok = not self.llm.errored and not self.generation.draining and not self.llm.restarting
        await self._respond(send, 200 if ok else 503, b"{}", extra)

    async def _version(self, scope: Scope, receive: Receive, send: Send, extra: list[Any]) -> None:
        kernels = self.llm.ready.kernels
        info = msgspec.structs.asdict(kernels) if kernels is not None else None
        await self._respond(send, 200, version_response(__version__, info), extra)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send, extra: list[Any]) -> None:
        if not self.llm.errored:
            with trio.move_on_after(2):
                async with trio.open_nursery() as nursery:
                    for engine in range(len(self.llm.engines)):
                        nursery.start_soon(self._engine_stats, engine)
        self.metrics.set_frontend_state(
            in_flight=self.generation.inflight, request_states=self.llm.num_request_states
        )
        self.metrics.set_engine_restarts(self.llm.restarts.total)
        headers = [(b"content-type", self.metrics.content_type.encode()), *extra]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": self.metrics.render()})

    async def _engine_stats(self, engine: int) -> None:
        """One engine's stats into the metrics (a dead one's load reads 0)."""
        if engine not in self.llm.live_engines():
            self.metrics.engine_gone(engine)
            return
        with contextlib.suppress(EngineDeadError):
            stats = await self.llm.utility("stats", engine=engine)
            if isinstance(stats, dict):
                self.metrics.set_engine_stats(stats, engine)
                return
        self.metrics.engine_gone(engine)

    async def _invocations(
        self, scope: Scope, receive: Receive, send: Send, extra: list[Any]
    ) -> None:
        body = await self._read_body(scope, receive)
        handler = self._routes.get(("POST", invocation_route(body)))
        if handler is None:
            raise not_found("route for this /invocations body (this server serves no embeddings)")
        await handler(scope, replayed(body, receive), send, extra)

    async def run_background(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Own the background responses' runs (`background: true`) until cancelled."""
        await self.responses.background.serve(task_status=task_status)

    @asynccontextmanager
    async def _open(
        self, scope: Scope, receive: Receive, kind: type[S], /, *, light: bool = False
    ) -> AsyncIterator[tuple[S, Held]]:
        """Every route's prologue (`Edge.open`): the body read whole (before admission: a slow
        client holds no place in the queue), the request admitted as generation (or `light`,
        at weight 1 without the generation checks), decoded, its model checked."""
        body = await self._read_body(scope, receive)
        with self.admission.hold() if light else self._admitted() as held:
            request = await self._decode(body, kind)
            self._check_model(getattr(request, "model", None))
            yield request, held

    def _rank(self, scope: Scope, body: int | None) -> int | None:
        """The engine a request is pinned to: its header, else `body` (the request's own
        `data_parallel_rank`); None leaves it to the router."""
        asked = header(scope, b"x-data-parallel-rank")
        return pinned_rank(asked, body, len(self.llm.engines))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            if model in self.llm.loras:
                return
            raise not_found(
                f"model {model!r} (this server serves {self.config.served_model_name!r})"
            )

    @contextmanager
    def _admitted(self) -> Iterator[Held]:
        """Admit a generation request at weight 1 or refuse it (503 dead or draining, 429
        overloaded); the handler grows the weight to prompts x n once it knows them.

        The request counts as in flight from this check to its end, with no checkpoint in
        between: counted any later (after the response starts), a burst of requests all pass
        the check before any of them is counted.
        """
        if self.llm.error is not None:  # before a stream's 200 starts
            raise RequestError(503, str(self.llm.error), "server_error")
        if self.dev is not None:
            self.dev.refuse_if_asleep()
        if self.generation.draining:
            raise RequestError(
                503, "the server is shutting down", "server_error", headers={"Retry-After": "5"}
            )
        if not self.admission.has_room():
            if self.llm.restarting:  # the queue is full of requests waiting for the engine
                raise RequestError(
                    503,
                    f"the engine is restarting and {self.generation.inflight} requests already "
                    f"wait for it (--max-queued-requests); retry later",
                    "server_error",
                    headers={"Retry-After": "5"},
                )
            raise overloaded(retry_after=1)
        with self.admission.hold() as held:
            self.generation.inflight += 1
            try:
                yield held
            finally:
                self.generation.inflight -= 1


def _request_id_header(scope: Scope) -> list[tuple[bytes, bytes]]:
    value = header(scope, b"x-request-id")
    return [(b"x-request-id", value)] if value is not None else []


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
