"""The pooling routes: POST /v1/embeddings (OpenAI's), /pooling, /score and /rerank (vLLM's).

Every input is one prefill-only request to the same engines as generation (`AsyncLLM.encode`):
no separate server, as vLLM's `--runner pooling` needs. The engine returns each prompt's
pooled hidden state raw; here it is cut to `dimensions` (Matryoshka) and normalised as the
model's pooler says (`client.load_pooler_config`: its sentence-transformers files, else
--pooler-config, else LAST with normalize). Scores are the cosine similarity of embeddings,
as vLLM computes them for an embedding model.

Prefix caching: LAST pooling reuses cached prefix blocks and computes only the rest; MEAN,
CLS and ALL read every position's hidden state, so they compute the whole input.

A client that disconnects (or a drain deadline) cancels the request's encodes, which abort
their engine requests, under the same `RequestScope` as generation.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import trio

from ...engine.client import (
    AsyncLLM,
    InvalidPromptError,
    PoolerConfig,
    PoolingOutput,
    PromptTooLongError,
    SamplingParams,
    SamplingParamsError,
    finish_embedding,
    load_pooler_config,
)
from ..edge._errors import RequestError
from ..edge._steps import Edge
from ..metrics._metrics import Metrics
from ._schema import (
    EmbeddingRequest,
    Prompt,
    RerankRequest,
    ScoreRequest,
    check_positive,
    encode_vector,
    inputs,
    list_response,
)

Scope = dict[str, Any]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[..., Awaitable[None]]
_encoder = msgspec.json.Encoder()


class PoolingAPI:
    """The pooling routes of one app; `routes()` goes into its route table.

    `generation` (`_generate.Generation`) lends its tokenizer threads, its metrics and its
    request scope (disconnects, the drain deadline)."""

    def __init__(self, edge: Edge, generation: Any, served_model_name: str) -> None:
        self.edge = edge
        self.generation = generation
        self.llm: AsyncLLM = generation.llm
        self.metrics: Metrics = generation.metrics
        self.model = served_model_name
        self.hidden_size: int | None = None  # learnt from the first result

    @functools.cached_property
    def pooler(self) -> PoolerConfig:
        """The pooler's settings, read at the first pooling request (the app is built before
        any request, in tests without an engine)."""
        config = self.llm.config
        return load_pooler_config(config.engine.worker.model, config.pooler_config)

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {
            ("POST", "/v1/embeddings"): self._embeddings,
            ("POST", "/pooling"): self._pooling,
            ("POST", "/score"): self._score,
            ("POST", "/v1/score"): self._score,
            ("POST", "/rerank"): self._rerank,
            ("POST", "/v1/rerank"): self._rerank,
        }

    # -- routes --------------------------------------------------------------------------

    async def _embeddings(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        await self._embed_route(scope, receive, send, extra, "embedding")

    async def _pooling(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        await self._embed_route(scope, receive, send, extra, "pooling")

    async def _embed_route(
        self, scope: Scope, receive: Any, send: Send, extra: Any, kind: str
    ) -> None:
        edge = self.edge
        async with edge.open(scope, receive, EmbeddingRequest) as (request, held):
            rank = edge.rank(scope, None)
            prompts = inputs(request.input)
            held.grow(len(prompts), what=f"{len(prompts)} inputs", param="input")
            check_positive(request.dimensions, "dimensions")
            check_positive(request.truncate_prompt_tokens, "truncate_prompt_tokens")
            self._check_dimensions(request.dimensions)
            async with self.generation.running(receive) as watch:
                outputs = await self._encode(prompts, "input", request, rank)
            if self._gone(watch):
                return
            self._check_dimensions(request.dimensions)
            normalize = self.pooler.normalize if request.normalize is None else request.normalize
            data = []
            for i, out in enumerate(outputs):
                rows = finish_embedding(
                    out.data, normalize=normalize, dimensions=request.dimensions
                )
                value = encode_vector(rows, request.encoding_format)
                key = "embedding" if kind == "embedding" else "data"
                data.append({"index": i, "object": kind, key: value})
            tokens = self._count(kind, outputs)
            answer = list_response(data, self.model, tokens, f"embd-{uuid.uuid4().hex}")
        await edge.respond(send, 200, _encoder.encode(answer), extra)

    async def _score(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        edge = self.edge
        async with edge.open(scope, receive, ScoreRequest) as (request, held):
            rank = edge.rank(scope, None)
            firsts = _texts(request.text_1, "text_1")
            seconds = _texts(request.text_2, "text_2")
            if len(firsts) != 1 and len(firsts) != len(seconds):
                raise RequestError(
                    400,
                    f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: send one text_1 "
                    f"(scored against each text_2) or as many as text_2 (scored in pairs)",
                    param="text_2",
                )
            held.grow(len(firsts) + len(seconds), what="texts", param="text_2")
            check_positive(request.truncate_prompt_tokens, "truncate_prompt_tokens")
            pair = await self._encode_pair(
                receive, request, firsts, "text_1", seconds, "text_2", rank
            )
            if pair is None:
                return
            left, right = pair
            scores = _cosines([left[0]] * len(right) if len(left) == 1 else left, right)
            data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
            tokens = self._count("score", [*left, *right])
            answer = list_response(data, self.model, tokens, f"score-{uuid.uuid4().hex}")
        await edge.respond(send, 200, _encoder.encode(answer), extra)

    async def _rerank(self, scope: Scope, receive: Any, send: Send, extra: Any) -> None:
        edge = self.edge
        async with edge.open(scope, receive, RerankRequest) as (request, held):
            rank = edge.rank(scope, None)
            query = _texts(request.query, "query")
            documents = _texts(request.documents, "documents")
            held.grow(1 + len(documents), what="1 query + documents", param="documents")
            check_positive(request.top_n, "top_n")
            check_positive(request.truncate_prompt_tokens, "truncate_prompt_tokens")
            pair = await self._encode_pair(
                receive, request, query, "query", documents, "documents", rank
            )
            if pair is None:
                return
            left, right = pair
            scores = _cosines([left[0]] * len(right), right)
            order = sorted(range(len(scores)), key=lambda i: -scores[i])[: request.top_n]
            results = [
                {
                    "index": i,
                    "relevance_score": scores[i],
                    **({"document": {"text": documents[i]}} if request.return_documents else {}),
                }
                for i in order
            ]
            tokens = self._count("rerank", [*left, *right])
        answer = {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": self.model,
            "usage": {"total_tokens": tokens},
            "results": results,
        }
        await edge.respond(send, 200, _encoder.encode(answer), extra)

    # -- helpers -------------------------------------------------------------------------

    async def _encode_pair(
        self,
        receive: Any,
        request: ScoreRequest | RerankRequest,
        lefts: Sequence[Prompt],
        left_field: str,
        rights: Sequence[Prompt],
        right_field: str,
        rank: int | None,
    ) -> tuple[list[PoolingOutput], list[PoolingOutput]] | None:
        """The two sides a score compares, encoded (on engine `rank`, when pinned) under the
        client's disconnect watch; None when the client went away (nobody to answer)."""
        async with self.generation.running(receive) as watch:
            left = await self._encode(list(lefts), left_field, request, rank)
            right = await self._encode(list(rights), right_field, request, rank)
        return None if self._gone(watch) else (left, right)

    def _gone(self, watch: trio.CancelScope) -> bool:
        """Whether the request's scope was cancelled: True if its client went away (nobody to
        answer); the drain deadline is a 503."""
        if not watch.cancelled_caught:
            return False
        if self.generation.draining:
            raise RequestError(503, "the server is shutting down", "server_error")
        return True

    async def _encode(
        self,
        prompts: list[Prompt],
        field: str,
        request: EmbeddingRequest | ScoreRequest | RerankRequest,
        rank: int | None,
    ) -> list[PoolingOutput]:
        """Every prompt as one pooling request, all at once (they batch in the engine), with
        the request's truncation, special tokens and cache salt, on engine `rank` when its
        header pinned one.

        Raises:
            RequestError: 400 naming cache_salt when it is empty or too long.
        """
        truncate_prompt_tokens, salt = request.truncate_prompt_tokens, request.cache_salt
        special = getattr(request, "add_special_tokens", True)
        try:
            SamplingParams(cache_salt=salt)  # generation's check of a salt
        except SamplingParamsError as err:
            raise RequestError(400, str(err), param="cache_salt") from None
        results: list[PoolingOutput | None] = [None] * len(prompts)
        errors: list[Exception] = []  # the first refusal is the answer (not a group of them)
        offload = self.generation.inputs.offload.run

        async def one(i: int, prompt: Prompt) -> None:
            size = len(prompt)

            async def run(fn: Callable[[], Any]) -> Any:
                return await offload(size, fn)

            try:
                with _named(field):
                    results[i] = await self.llm.encode(
                        prompt,
                        self.pooler.pooling_type,
                        truncate_prompt_tokens=truncate_prompt_tokens,
                        add_special_tokens=special,
                        cache_salt=salt,
                        data_parallel_rank=rank,
                        run=run,
                    )
            except Exception as exc:
                errors.append(exc)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for i, prompt in enumerate(prompts):
                nursery.start_soon(one, i, prompt)
        if errors:
            raise errors[0]
        done = [r for r in results if r is not None]
        if done and self.hidden_size is None:
            self.hidden_size = int(done[0].data.shape[1])
        return done

    def _check_dimensions(self, dimensions: int | None) -> None:
        hidden = self.hidden_size
        if dimensions is not None and hidden is not None and dimensions > hidden:
            raise RequestError(
                400,
                f"dimensions is {dimensions}, more than the model's embedding size {hidden}: "
                f"ask for at most {hidden}",
                param="dimensions",
            )

    def _count(self, endpoint: str, outputs: Sequence[PoolingOutput]) -> int:
        tokens = sum(o.num_prompt_tokens for o in outputs)
        self.metrics.observe_pooling(endpoint, len(outputs), tokens)
        return tokens


def _texts(value: str | list[str], field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts or not all(texts):
        raise RequestError(400, f"{field} is empty: send at least one non-empty text", param=field)
    return texts


def _cosines(left: Sequence[PoolingOutput], right: Sequence[PoolingOutput]) -> list[float]:
    """Cosine similarity of each pair's first rows (float32, as vLLM's embedding scores)."""
    a = np.stack([o.data[0] for o in left]).astype(np.float32)
    b = np.stack([o.data[0] for o in right]).astype(np.float32)
    a /= np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b /= np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return [float(x) for x in (a * b).sum(1)]


@contextmanager
def _named(field: str) -> Iterator[None]:
    """A prompt's refusal names the route's own field (`input`, `text_1`, `documents`...)."""
    try:
        yield
    except PromptTooLongError as exc:
        raise RequestError(400, str(exc), param=field) from None
    except InvalidPromptError as exc:
        raise RequestError(400, str(exc), param=field) from None
