"""Writes `components.json`: the component schemas the schema test checks against, with every
schema they reference, from OpenAI's published spec; not a test (it reads no server).

Run: `python tests/http/openai_schema/extract.py path/to/openapi.json COMMIT`. Descriptions,
examples and `x-oaiMeta` are dropped (they constrain nothing); every other keyword is kept.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOTS = [
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "CreateEmbeddingResponse",
    "ListModelsResponse",
    "Model",
    "Response",
    "ResponseStreamEvent",
    "ErrorResponse",
]
PREFIX = "#/components/schemas/"
DROPPED = {"description", "example", "examples", "x-oaiMeta"}


NAMES = {"properties", "patternProperties", "$defs", "definitions"}  # keys there are names


def stripped(node: Any, *, names: bool = False) -> Any:
    """`node` without the annotations; a map of names (`properties`) keeps every name, so a
    property called `description` stays."""
    if isinstance(node, dict):
        return {
            k: stripped(v, names=k in NAMES and not names)
            for k, v in node.items()
            if names or k not in DROPPED
        }
    if isinstance(node, list):
        return [stripped(v) for v in node]
    return node


def refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"][len(PREFIX) :]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    return set()


def main(spec_path: str, commit: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    schemas = spec["components"]["schemas"]
    kept: dict[str, Any] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in kept:
            kept[name] = stripped(schemas[name])
            todo += sorted(refs(kept[name]) - set(kept))
    out = {
        "source": f"openai/openai-openapi openapi.json at {commit} (info.version "
        f"{spec['info']['version']}, OpenAPI {spec['openapi']})",
        "roots": ROOTS,
        "schemas": dict(sorted(kept.items())),
    }
    target = Path(__file__).with_name("components.json")
    target.write_text(json.dumps(out, indent=1, sort_keys=False) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
