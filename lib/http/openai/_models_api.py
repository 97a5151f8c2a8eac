"""`GET /v1/models` and `GET /v1/models/{model}` (OpenAI's): the served model and each LoRA
adapter, with vLLM's `root` and `parent`.

A `root` is a server path only for dev endpoints' users: vLLM shows an adapter's directory
(and a model started from a directory) to anyone, telling every key holder the server's
directories. Otherwise an adapter's root is its name, and a model started from a path on
this machine has its served name as its root; a hub id (`org/name`) is shown as vLLM shows it.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from ..edge._errors import not_found
from ._info_responses import ModelCard, model_cards, model_response, models_response

Scope = dict[str, Any]
Respond = Callable[..., Awaitable[None]]
PREFIX = "/v1/models/"  # then the model's id, which may hold slashes (`org/name`)


class ModelsAPI:
    """The model routes of one app: `list_models` for `/v1/models`, `retrieve` for one id."""

    def __init__(self, llm: Any, served_model_name: str, *, dev: bool, respond: Respond) -> None:
        self.llm = llm
        self.served = served_model_name
        self.dev = dev
        self.respond = respond
        self._root: str | None = None  # the served model's, found on first use

    async def list_models(self, scope: Scope, receive: Any, send: Any, extra: list[Any]) -> None:
        body = models_response(
            [self.served],
            max_model_len=self.llm.max_model_len,
            root=self.root(),
            adapters=self.adapters(),
        )
        await self.respond(send, 200, body, extra)

    async def retrieve(self, scope: Scope, receive: Any, send: Any, extra: list[Any]) -> None:
        model = scope["path"][len(PREFIX) :]
        card = self.card(model)
        if card is None:
            raise not_found(
                f"the model {model!r} (this server serves {self.served!r})",
                param="model",
                code="model_not_found",
            )
        await self.respond(send, 200, model_response(card), extra)

    def card(self, model: str) -> ModelCard | None:
        """`model`'s card (the served model or an adapter), or None for an unknown id."""
        cards = model_cards(
            [self.served],
            max_model_len=self.llm.max_model_len,
            root=self.root(),
            adapters=self.adapters(),
        )
        return next((card for card in cards if card.id == model), None)

    def root(self) -> str:
        """The model argument the server was started with, unless it is a path here."""
        if self._root is None:
            model = str(self.llm.config.engine.worker.model)
            local = os.path.isabs(model) or model.startswith(".") or os.path.exists(model)
            self._root = model if self.dev or not local else self.served
        return self._root

    def adapters(self) -> list[tuple[str, str, str]]:
        """(name, root, base model) of every loaded adapter."""
        return [
            (m.name, m.path if self.dev else m.name, m.base_model_name or self.served)
            for m in self.llm.loras.modules()
        ]
