"""`_models_api`: which root a card shows, and the card `GET /v1/models/{model}` finds."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trillm.http.openai._models_api import ModelsAPI


def api(model: str, *, dev: bool = False) -> ModelsAPI:
    adapter = SimpleNamespace(name="sql", path="/srv/adapters/sql", base_model_name=None)
    llm: Any = SimpleNamespace(
        max_model_len=64,
        config=SimpleNamespace(engine=SimpleNamespace(worker=SimpleNamespace(model=model))),
        loras=SimpleNamespace(modules=lambda: [adapter]),
    )

    async def respond(*args: Any) -> None:
        raise AssertionError("not called here")

    return ModelsAPI(llm, "tiny", dev=dev, respond=respond)


@pytest.mark.parametrize(
    ("model", "dev", "root"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", False, "HuggingFaceTB/SmolLM2-135M-Instruct"),
        ("/srv/models/llama", False, "tiny"),  # a path here: the served name stands for it
        ("./models/llama", False, "tiny"),
        ("/srv/models/llama", True, "/srv/models/llama"),  # dev endpoints' users see it
    ],
)
def test_the_served_model_s_root(model: str, dev: bool, root: str) -> None:
    assert api(model, dev=dev).root() == root


def test_a_relative_path_that_exists_is_a_path(tmp_path: Path, monkeypatch: Any) -> None:
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert api("org/model").root() == "tiny"


def test_cards_by_id() -> None:
    models = api("org/model")
    served, adapter = models.card("tiny"), models.card("sql")
    assert served is not None and (served.root, served.parent) == ("org/model", None)
    assert adapter is not None and (adapter.root, adapter.parent) == ("sql", "tiny")
    assert api("org/model", dev=True).adapters() == [("sql", "/srv/adapters/sql", "tiny")]
    assert models.card("nothing") is None
