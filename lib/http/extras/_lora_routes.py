"""LoRA adapters over HTTP, as vLLM serves them: `model` names one, `/v1/models` lists them
with their `parent`, and `POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter`
(vLLM's bodies: `lora_name`, `lora_path`) change them at run time, only with
`--enable-runtime-lora-updating` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, as a flag).

A bad adapter is a 400 with the engine's reason (a pickle, an unknown target, a rank over
the limit, another base model), and changes nothing: the server goes on serving. A name is
at most `MAX_LORA_NAME` characters and never the served model's (every tenant's requests
for the model would run through the adapter); a path at most `MAX_LORA_PATH` (PATH_MAX), and
the reason a path is refused does not say whether it exists on the server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import msgspec

from ...engine.client import AsyncLLM, LoraAdapterExistsError, LoraNotFoundError
from ..edge._errors import RequestError, not_found

Scope = dict[str, Any]


MAX_LORA_NAME = 256
MAX_LORA_PATH = 4096
Name = Annotated[str, msgspec.Meta(max_length=MAX_LORA_NAME)]


class LoadLoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: Name
    lora_path: Annotated[str, msgspec.Meta(max_length=MAX_LORA_PATH)]
    base_model_name: Name | None = None


class UnloadLoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: Name
    lora_int_id: int | None = None  # vLLM's, accepted and unread: names are unique


class LoraRoutes:
    """The two runtime routes; `routes()` goes into the app's route table. The app lends
    its steps: read the body, decode it, respond."""

    def __init__(
        self,
        llm: AsyncLLM,
        served_model_name: str,
        read_body: Callable[[Scope, Any], Awaitable[bytes]],
        decode: Callable[[bytes, Any], Awaitable[Any]],
        respond: Callable[[Any, int, bytes, list[Any]], Awaitable[None]],
    ) -> None:
        self.llm, self.served_model_name = llm, served_model_name
        self.read_body, self.decode, self.respond = read_body, decode, respond

    def routes(self) -> dict[tuple[str, str], Any]:
        return {
            ("POST", "/v1/load_lora_adapter"): self._load,
            ("POST", "/v1/unload_lora_adapter"): self._unload,
        }

    async def _load(self, scope: Scope, receive: Any, send: Any, extra: list[Any]) -> None:
        body = await self.read_body(scope, receive)
        request: LoadLoraAdapterRequest = await self.decode(body, LoadLoraAdapterRequest)
        if not request.lora_name or not request.lora_path:
            raise RequestError(400, "lora_name and lora_path must not be empty", param="lora_name")
        if request.lora_name == self.served_model_name:
            raise RequestError(
                400,
                f"lora_name {request.lora_name!r} is the served model's name: requests for the "
                f"model would run through the adapter; give the adapter another name",
                param="lora_name",
            )
        try:
            await self.llm.load_lora_adapter(
                request.lora_name, request.lora_path, request.base_model_name
            )
        except LoraAdapterExistsError as exc:
            raise RequestError(400, str(exc), param="lora_name") from None
        except ValueError as exc:  # the engines refused it: a bad adapter, LoRA off
            raise RequestError(400, str(exc), param="lora_path") from None
        text = f"Success: LoRA adapter '{request.lora_name}' added successfully."
        await self.respond(send, 200, text.encode(), extra)

    async def _unload(self, scope: Scope, receive: Any, send: Any, extra: list[Any]) -> None:
        body = await self.read_body(scope, receive)
        request: UnloadLoraAdapterRequest = await self.decode(body, UnloadLoraAdapterRequest)
        try:
            await self.llm.unload_lora_adapter(request.lora_name)
        except LoraNotFoundError:
            raise not_found(f"the LoRA adapter {request.lora_name!r}", param="lora_name") from None
        text = f"Success: LoRA adapter '{request.lora_name}' removed successfully."
        await self.respond(send, 200, text.encode(), extra)
