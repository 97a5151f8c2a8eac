"""Request fields trillm does not know: served as vLLM serves them, ignored and logged.

OpenAI answers an unknown field with a 400; vLLM ignores it and logs a warning, and clients
written against vLLM (or a newer OpenAI) send fields this server has not met. trillm does as
vLLM: the request is served, and the server's log names each unknown top-level field, once
per route's body kind and name (`MAX_LOGGED` names in all), so a typo (`"temprature"`) is
visible to the operator without a line per request.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

log = logging.getLogger("trillm.http")
MAX_LOGGED = 256

_keys = msgspec.json.Decoder(dict[str, msgspec.Raw])  # values left undecoded
_logged: set[tuple[str, str]] = set()


def log_unknown_fields(body: bytes, kind: type[Any]) -> list[str]:
    """The top-level fields of `body` (decoded as `kind` already) that `kind` has not; each
    logged the first time it is seen for `kind`."""
    known = _fields_of(kind)
    try:
        unknown = [name for name in _keys.decode(body) if name not in known]
    except msgspec.DecodeError:
        return []
    for name in unknown:
        key = (kind.__name__, name)
        if key not in _logged and len(_logged) < MAX_LOGGED:
            _logged.add(key)
            log.warning(
                "trillm: a %s field the server does not know was ignored: %r (vLLM ignores "
                "unknown fields too; OpenAI would answer 400)",
                kind.__name__,
                name[:100],
            )
    return unknown


_known: dict[type[Any], frozenset[str]] = {}


def _fields_of(kind: type[Any]) -> frozenset[str]:
    names = _known.get(kind)
    if names is None:
        names = _known[kind] = frozenset(f.encode_name for f in msgspec.structs.fields(kind))
    return names
