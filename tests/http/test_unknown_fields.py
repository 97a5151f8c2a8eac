"""A field the server does not know is served as vLLM serves it: ignored, and logged once per
body kind and name (OpenAI would answer 400), so an operator sees a client's typo."""

from __future__ import annotations

import logging

import pytest

from trillm.http.edge import _unknown_fields
from trillm.http.openai._requests import ChatCompletionRequest, CompletionRequest, decode_request


def test_an_unknown_field_is_logged_once_and_the_request_served(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_unknown_fields, "_logged", set())
    body = b'{"prompt": "x", "temprature": 0, "max_tokens": 2}'
    with caplog.at_level(logging.WARNING, logger="trillm.http"):
        request = decode_request(body, CompletionRequest)
        decode_request(body, CompletionRequest)  # the same name again: no second line
        chat = b'{"messages": [{"role": "user", "content": "Hi"}], "temprature": 0}'
        decode_request(chat, ChatCompletionRequest)
    assert request.max_tokens == 2 and request.temperature == 1.0  # the typo changed nothing
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "trillm: a CompletionRequest field the server does not know was ignored: 'temprature' "
        "(vLLM ignores unknown fields too; OpenAI would answer 400)",
        "trillm: a ChatCompletionRequest field the server does not know was ignored: "
        "'temprature' (vLLM ignores unknown fields too; OpenAI would answer 400)",
    ]
    assert _unknown_fields.log_unknown_fields(b'{"prompt": "x"}', CompletionRequest) == []


def test_the_names_logged_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_unknown_fields, "_logged", set())
    for i in range(_unknown_fields.MAX_LOGGED + 50):
        decode_request(f'{{"prompt": "x", "f{i}": 1}}'.encode(), CompletionRequest)
    assert len(_unknown_fields._logged) == _unknown_fields.MAX_LOGGED
