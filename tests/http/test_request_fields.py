"""No request field is silently ignored (issue 47): every field of the request Structs that
trillm decodes either shows its effect in a response or is a 400 whose `param` names it.

`CHECKS` maps each (Struct, field) to a check run against a live server; the table is
compared with the Structs' fields (`msgspec.structs.fields`), so a field added later without
a check fails `test_every_request_field_has_a_check`. Where a behaviour mirrors one of vLLM's
tests (tests/entrypoints/openai), the check's docstring names it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from trillm.http.openai import _requests as R

from .conftest import Server, start_server

CHAT_ASK = [{"role": "user", "content": "Tell me a saying."}]
SAYING = "An apple a day keeps"
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
STRUCTS = (R.CompletionRequest, R.ChatCompletionRequest, R.StreamOptions)


@pytest.fixture(scope="module")
def live(tiny_model: Path) -> Iterator[Server]:
    server = start_server(tiny_model, "--enable-prompt-tokens-details")
    try:
        yield server
    finally:
        server.stop()


def post(server: Server, kind: str, **fields: Any) -> httpx.Response:
    base: dict[str, Any] = {"prompt": "Hello there, my friend"} if kind == "completion" else {}
    if kind == "chat" and "messages" not in fields:
        base["messages"] = CHAT_ASK
    return httpx.post(f"{server.base_url}{PATHS[kind]}", json={**base, **fields}, timeout=60)


def ok(server: Server, kind: str, **fields: Any) -> dict[str, Any]:
    r = post(server, kind, **fields)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def refused(server: Server, kind: str, param: str, **fields: Any) -> str:
    r = post(server, kind, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


def text(body: dict[str, Any], i: int = 0) -> str:
    choice = body["choices"][i]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def token_ids(server: Server, kind: str, **fields: Any) -> list[int]:
    return list(ok(server, kind, return_token_ids=True, **fields)["choices"][0]["token_ids"])


def events(server: Server, kind: str, **fields: Any) -> list[dict[str, Any]]:
    r = post(server, kind, stream=True, **fields)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    lines = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# -- the shared fields (both kinds) ---------------------------------------------------------


def check_model(s: Server, kind: str) -> None:
    assert ok(s, kind, model="tiny", max_tokens=1)["model"] == "tiny"
    assert post(s, kind, model="not-served", max_tokens=1).status_code == 404


def check_temperature(s: Server, kind: str) -> None:
    hot = {**GREEDY, "temperature": 100}
    assert text(ok(s, kind, **GREEDY, seed=1)) == text(ok(s, kind, **GREEDY, seed=2))
    assert text(ok(s, kind, **hot, seed=1)) != text(ok(s, kind, **hot, seed=2))


def _greedy_when(s: Server, kind: str, **narrowing: Any) -> None:
    """A narrowing field makes a hot sampler pick the greedy tokens."""
    greedy = text(ok(s, kind, **GREEDY))
    for seed in (1, 2):
        hot = {**GREEDY, "temperature": 100, "seed": seed}
        assert text(ok(s, kind, **hot, **narrowing)) == greedy


def check_n(s: Server, kind: str) -> None:
    """vLLM's test_completion.py n>1 cases: n choices, indexed."""
    body = ok(s, kind, n=3, max_tokens=2)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]


def check_stream(s: Server, kind: str) -> None:
    chunks = events(s, kind, **GREEDY)
    assert "".join(_delta(c) for c in chunks) == text(ok(s, kind, **GREEDY))


def _delta(chunk: dict[str, Any]) -> str:
    if not chunk["choices"]:
        return ""
    choice = chunk["choices"][0]
    return str(choice.get("text") or choice.get("delta", {}).get("content") or "")


def check_stream_options(s: Server, kind: str) -> None:
    refused(s, kind, "stream_options", stream_options={"include_usage": True})
    assert events(s, kind, max_tokens=2, stream_options={"include_usage": True})[-1]["usage"]


def _stop_of(s: Server, kind: str) -> tuple[str, str]:
    greedy = text(ok(s, kind, **GREEDY))
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 2]
    assert stop, greedy
    return greedy, stop


def check_stop(s: Server, kind: str) -> None:
    greedy, stop = _stop_of(s, kind)
    body = ok(s, kind, **GREEDY, stop=[stop])
    assert text(body) == greedy[: greedy.index(stop)]
    assert body["choices"][0]["stop_reason"] == stop


def check_include_stop_str_in_output(s: Server, kind: str) -> None:
    greedy, stop = _stop_of(s, kind)
    body = ok(s, kind, **GREEDY, stop=[stop], include_stop_str_in_output=True)
    assert text(body) == greedy[: greedy.index(stop) + len(stop)]


def _changes_greedy(**penalty: Any) -> Callable[[Server, str], None]:
    def check(s: Server, kind: str) -> None:
        long = {**GREEDY, "max_tokens": 24}
        assert token_ids(s, kind, **long) != token_ids(s, kind, **long, **penalty)

    return check


def check_seed(s: Server, kind: str) -> None:
    hot = {**GREEDY, "temperature": 1.5}
    assert text(ok(s, kind, **hot, seed=7)) == text(ok(s, kind, **hot, seed=7))
    assert text(ok(s, kind, **hot, seed=7)) != text(ok(s, kind, **hot, seed=8))


def check_min_tokens(s: Server, kind: str) -> None:
    eos = _eos(s, kind)
    bias = {str(eos): 100}
    assert len(token_ids(s, kind, max_tokens=8, logit_bias=bias)) <= 1
    assert len(token_ids(s, kind, max_tokens=8, logit_bias=bias, min_tokens=5)) >= 5


def _eos(s: Server, kind: str) -> int:
    """The token the model stops on (a greedy choice forced to end names it)."""
    ids = token_ids(s, kind, max_tokens=4, temperature=0, logit_bias={"2": 100})
    assert ids == [2], ids  # SmolLM2's <|im_end|>: the tiny model's end of sequence
    return 2


def check_logit_bias(s: Server, kind: str) -> None:
    assert set(token_ids(s, kind, **GREEDY, logit_bias={"3289": 100})) == {3289}
    refused(s, kind, "logit_bias", logit_bias={"x": 1})


def check_ignore_eos(s: Server, kind: str) -> None:
    bias = {str(_eos(s, kind)): 100}
    assert len(token_ids(s, kind, max_tokens=6, logit_bias=bias, ignore_eos=True)) == 6


def check_stop_token_ids(s: Server, kind: str) -> None:
    ids = token_ids(s, kind, **GREEDY)
    stopped = ok(s, kind, **GREEDY, stop_token_ids=[ids[3]], return_token_ids=True)
    choice = stopped["choices"][0]
    assert choice["stop_reason"] == ids[3]
    assert choice["token_ids"] == ids[: ids.index(ids[3]) + 1]


def check_skip_special_tokens(s: Server, kind: str) -> None:
    forced = {**GREEDY, "max_tokens": 3, "logit_bias": {"1": 100}}  # <|im_start|>
    assert text(ok(s, kind, **forced)) == ""
    assert text(ok(s, kind, **forced, skip_special_tokens=False)) == "<|im_start|>" * 3


def check_return_tokens_as_token_ids(s: Server, kind: str) -> None:
    """vLLM's test_return_tokens_as_ids.py."""
    logprobs: dict[str, Any] = {"logprobs": 1} if kind == "completion" else {"logprobs": True}
    body = ok(s, kind, **GREEDY, **logprobs, return_tokens_as_token_ids=True)
    lp = body["choices"][0]["logprobs"]
    tokens = lp["tokens"] if kind == "completion" else [e["token"] for e in lp["content"]]
    assert all(t.startswith("token_id:") for t in tokens), tokens


def check_structured_outputs(s: Server, kind: str) -> None:
    body = ok(s, kind, max_tokens=8, structured_outputs={"choice": ["yes", "no"]})
    assert text(body) in ("yes", "no")


def check_response_format(s: Server, kind: str) -> None:
    schema = {"enum": ["alpha", "beta"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    assert json.loads(text(ok(s, kind, max_tokens=12, response_format=fmt))) in schema["enum"]


def check_cache_salt(s: Server, kind: str) -> None:
    long = "The salted prompt is long enough to fill a few blocks of the cache. " * 6
    field = {"prompt": long} if kind == "completion" else {"messages": [_user(long)]}

    def cached(**salt: Any) -> int:
        body = ok(s, kind, max_tokens=1, **field, **salt)
        return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

    cached(cache_salt=f"a-{kind}")
    assert cached(cache_salt=f"a-{kind}") > 0
    assert cached(cache_salt=f"b-{kind}") == 0
    refused(s, kind, "cache_salt", cache_salt="")


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def check_data_parallel_rank(s: Server, kind: str) -> None:
    ok(s, kind, max_tokens=1, data_parallel_rank=0)
    refused(s, kind, "data_parallel_rank", max_tokens=1, data_parallel_rank=4)


def check_thinking_token_budget(s: Server, kind: str) -> None:
    message = refused(s, kind, "thinking_token_budget", thinking_token_budget=4)
    assert "--reasoning-parser" in message


def check_prompt_logprobs(s: Server, kind: str) -> None:
    """vLLM's test_chat_echo.py::test_prompt_logprobs (chat: at the top) and
    test_completion.py's prompt_logprobs cases (completions: on each choice); -1, the whole
    vocabulary, is refused here, and so are prompt logprobs in a stream (as vLLM)."""
    body = ok(s, kind, max_tokens=1, prompt_logprobs=2, return_token_ids=True)
    where = body["choices"][0] if kind == "completion" else body
    prompt_ids, lps = where["prompt_token_ids"], where["prompt_logprobs"]
    assert len(lps) == len(prompt_ids) and lps[0] is None
    for token, position in zip(prompt_ids[1:], lps[1:], strict=True):
        assert str(token) in position and 2 <= len(position) <= 3
        ranks = sorted(e["rank"] for e in position.values() if e["rank"] is not None)
        assert ranks == [1, 2]
    assert "-1" in refused(s, kind, "prompt_logprobs", prompt_logprobs=-1)
    refused(s, kind, "prompt_logprobs", prompt_logprobs=1, stream=True)


def check_return_token_ids(s: Server, kind: str) -> None:
    """vLLM's test_return_token_ids.py: prompt_token_ids (completions: on each choice; chat:
    at the top, and on a stream's first chunk) and each choice's token_ids."""
    body = ok(s, kind, **GREEDY, return_token_ids=True)
    choice = body["choices"][0]
    prompt_ids = (choice if kind == "completion" else body)["prompt_token_ids"]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    assert len(prompt_ids) == body["usage"]["prompt_tokens"]
    streamed = events(s, kind, **GREEDY, return_token_ids=True)
    assert [i for c in streamed for i in c["choices"][0].get("token_ids", [])] == choice[
        "token_ids"
    ]
    plain = ok(s, kind, **GREEDY)
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain


def check_use_beam_search(s: Server, kind: str) -> None:
    message = refused(s, kind, "use_beam_search", use_beam_search=True)
    assert message.startswith("use_beam_search is not supported")
    ok(s, kind, max_tokens=1, use_beam_search=False)


def check_best_of(s: Server, kind: str) -> None:
    refused(s, kind, "best_of", best_of=3, n=1)
    assert len(ok(s, kind, max_tokens=1, best_of=2, n=2)["choices"]) == 2


def check_user(s: Server, kind: str) -> None:
    """OpenAI's end-user id is an annotation that changes no output by its definition: the
    check is that it is taken as a string and refused otherwise."""
    ok(s, kind, max_tokens=1, user="someone")
    refused(s, kind, "user", user=3)


def check_max_tokens(s: Server, kind: str) -> None:
    body = ok(s, kind, **{**GREEDY, "max_tokens": 3})
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (
        3,
        "length",
    )


def check_logprobs(s: Server, kind: str) -> None:
    if kind == "completion":
        lp = ok(s, kind, **GREEDY, logprobs=2)["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 12 and all(len(t) >= 2 for t in lp["top_logprobs"])
    else:
        lp = ok(s, kind, **GREEDY, logprobs=True)["choices"][0]["logprobs"]
        assert len(lp["content"]) == 12


SHARED: dict[str, Callable[[Server, str], None]] = {
    "model": check_model,
    "temperature": check_temperature,
    "top_p": lambda s, k: _greedy_when(s, k, top_p=1e-9),
    "top_k": lambda s, k: _greedy_when(s, k, top_k=1),
    "min_p": lambda s, k: _greedy_when(s, k, min_p=1.0),
    "n": check_n,
    "stream": check_stream,
    "stream_options": check_stream_options,
    "stop": check_stop,
    "presence_penalty": _changes_greedy(presence_penalty=2.0),
    "frequency_penalty": _changes_greedy(frequency_penalty=2.0),
    "repetition_penalty": _changes_greedy(repetition_penalty=5.0),
    "min_tokens": check_min_tokens,
    "seed": check_seed,
    "logit_bias": check_logit_bias,
    "user": check_user,
    "ignore_eos": check_ignore_eos,
    "stop_token_ids": check_stop_token_ids,
    "include_stop_str_in_output": check_include_stop_str_in_output,
    "skip_special_tokens": check_skip_special_tokens,
    "return_tokens_as_token_ids": check_return_tokens_as_token_ids,
    "structured_outputs": check_structured_outputs,
    "response_format": check_response_format,
    "cache_salt": check_cache_salt,
    "data_parallel_rank": check_data_parallel_rank,
    "thinking_token_budget": check_thinking_token_budget,
    "prompt_logprobs": check_prompt_logprobs,
    "return_token_ids": check_return_token_ids,
    "use_beam_search": check_use_beam_search,
    "best_of": check_best_of,
    "max_tokens": check_max_tokens,
    "logprobs": check_logprobs,
}


# -- completions' own fields ---------------------------------------------------------------


def check_prompt(s: Server, kind: str) -> None:
    short = ok(s, kind, prompt="Hi", max_tokens=1, return_token_ids=True)["choices"][0]
    assert ok(s, kind, prompt=short["prompt_token_ids"], **GREEDY)["choices"][0]["text"] == text(
        ok(s, kind, prompt="Hi", **GREEDY)
    )
    refused(s, kind, "prompt", prompt=[])


def check_completion_echo(s: Server, kind: str) -> None:
    assert text(ok(s, kind, prompt="Hello there", max_tokens=2, echo=True)).startswith(
        "Hello there"
    )


def check_prompt_embeds(s: Server, kind: str) -> None:
    assert "--enable-prompt-embeds" in refused(
        s, kind, "prompt_embeds", prompt="", prompt_embeds="x"
    )


# -- chat's own fields ---------------------------------------------------------------------


def _prompt_ids(s: Server, **fields: Any) -> list[int]:
    return list(ok(s, "chat", max_tokens=1, return_token_ids=True, **fields)["prompt_token_ids"])


def check_messages(s: Server, kind: str) -> None:
    assert len(_prompt_ids(s, messages=[_user("Hi " * 20)])) > len(
        _prompt_ids(s, messages=[_user("Hi")])
    )
    refused(s, kind, "messages", messages=[])


def check_max_completion_tokens(s: Server, kind: str) -> None:
    body = ok(s, kind, **{**GREEDY, "max_tokens": 6}, max_completion_tokens=2)
    assert body["usage"]["completion_tokens"] == 2


def check_top_logprobs(s: Server, kind: str) -> None:
    lp = ok(s, kind, **GREEDY, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]
    assert all(len(e["top_logprobs"]) == 3 for e in lp["content"])
    refused(s, kind, "top_logprobs", top_logprobs=2)


TOOL = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}


def check_tools(s: Server, kind: str) -> None:
    body = ok(s, kind, max_tokens=48, temperature=0, tools=[TOOL], tool_choice="required",
              parallel_tool_calls=False)  # fmt: skip
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == ["ping"]


def check_tool_choice(s: Server, kind: str) -> None:
    named = {"type": "function", "function": {"name": "ping"}}
    body = ok(s, kind, max_tokens=48, temperature=0, tools=[TOOL], tool_choice=named)
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "ping"
    assert (
        "tool_calls"
        not in ok(s, kind, max_tokens=4, tools=[TOOL], tool_choice="none")["choices"][0]["message"]
    )


def check_parallel_tool_calls(s: Server, kind: str) -> None:
    """false: one call at most (the grammar closes after it), however many tools are sent."""
    tools = [TOOL, {**TOOL, "function": {**TOOL["function"], "name": "pong"}}]
    for seed in range(3):
        body = ok(s, kind, max_tokens=96, temperature=1.0, seed=seed, tools=tools,
                  tool_choice="required", parallel_tool_calls=False)  # fmt: skip
        assert len(body["choices"][0]["message"]["tool_calls"]) == 1


def check_chat_template_kwargs(s: Server, kind: str) -> None:
    refused(s, kind, "chat_template_kwargs.tools", chat_template_kwargs={"tools": []})
    ok(s, kind, max_tokens=1, chat_template_kwargs={"some_variable": 1})


def check_reasoning_effort(s: Server, kind: str) -> None:
    refused(s, kind, "reasoning_effort", reasoning_effort="extreme")


CONTINUED = [*CHAT_ASK, {"role": "assistant", "content": SAYING}]


def check_chat_echo(s: Server, kind: str) -> None:
    """vLLM's test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message."""
    fields = {"messages": CONTINUED, "continue_final_message": True, "add_generation_prompt": False}
    echoed = ok(s, kind, **GREEDY, **fields, echo=True)
    assert text(echoed) == SAYING + text(ok(s, kind, **GREEDY, **fields))
    first = events(s, kind, **GREEDY, **fields, echo=True)[0]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": SAYING}
    # the last message the user's: as vLLM, nothing of the reply's role to repeat
    user_last = {"messages": [{"role": "user", "content": "Hi"}]}
    plain = text(ok(s, kind, **GREEDY, **user_last))
    assert text(ok(s, kind, **GREEDY, **user_last, echo=True)) == plain


def check_add_generation_prompt(s: Server, kind: str) -> None:
    opened = _prompt_ids(s)
    closed = _prompt_ids(s, add_generation_prompt=False)
    assert opened[: len(closed)] == closed and len(opened) > len(closed)


def check_continue_final_message(s: Server, kind: str) -> None:
    closed = _prompt_ids(s, messages=CONTINUED, add_generation_prompt=False)
    continued = _prompt_ids(
        s, messages=CONTINUED, add_generation_prompt=False, continue_final_message=True
    )
    assert closed[: len(continued)] == continued and len(continued) < len(closed)
    refused(s, kind, "continue_final_message", messages=CONTINUED, continue_final_message=True)


# -- stream options ------------------------------------------------------------------------


def check_include_usage(s: Server, kind: str) -> None:
    chunks = events(s, kind, **GREEDY, stream_options={"include_usage": True})
    assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def check_continuous_usage_stats(s: Server, kind: str) -> None:
    """vLLM's test_completion.py / test_chat.py continuous_usage_stats cases: each chunk
    carries its choice's usage so far."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = events(s, kind, **GREEDY, stream_options=options)
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 12
    assert all(c["usage"]["total_tokens"] > c["usage"]["completion_tokens"] for c in chunks)


KINDS = {R.CompletionRequest: "completion", R.ChatCompletionRequest: "chat", R.StreamOptions: ""}
CHECKS: dict[tuple[type[Any], str], Callable[[Server, str], None]] = {
    **{(R.CompletionRequest, f): c for f, c in SHARED.items()},
    **{(R.ChatCompletionRequest, f): c for f, c in SHARED.items()},
    (R.CompletionRequest, "prompt"): check_prompt,
    (R.CompletionRequest, "echo"): check_completion_echo,
    (R.CompletionRequest, "prompt_embeds"): check_prompt_embeds,
    (R.ChatCompletionRequest, "messages"): check_messages,
    (R.ChatCompletionRequest, "max_completion_tokens"): check_max_completion_tokens,
    (R.ChatCompletionRequest, "top_logprobs"): check_top_logprobs,
    (R.ChatCompletionRequest, "tools"): check_tools,
    (R.ChatCompletionRequest, "tool_choice"): check_tool_choice,
    (R.ChatCompletionRequest, "parallel_tool_calls"): check_parallel_tool_calls,
    (R.ChatCompletionRequest, "chat_template_kwargs"): check_chat_template_kwargs,
    (R.ChatCompletionRequest, "reasoning_effort"): check_reasoning_effort,
    (R.ChatCompletionRequest, "echo"): check_chat_echo,
    (R.ChatCompletionRequest, "add_generation_prompt"): check_add_generation_prompt,
    (R.ChatCompletionRequest, "continue_final_message"): check_continue_final_message,
    (R.StreamOptions, "include_usage"): check_include_usage,
    (R.StreamOptions, "continuous_usage_stats"): check_continuous_usage_stats,
}


def test_every_request_field_has_a_check() -> None:
    fields = {(kind, f.name) for kind in STRUCTS for f in msgspec.structs.fields(kind)}
    assert sorted((k.__name__, f) for k, f in fields - CHECKS.keys()) == []
    assert sorted((k.__name__, f) for k, f in CHECKS.keys() - fields) == []


@pytest.mark.parametrize(
    ("struct", "field"), sorted(CHECKS, key=lambda k: (k[0].__name__, k[1])),
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)  # fmt: skip
def test_the_field_works_or_is_a_400_naming_it(live: Server, struct: type[Any], field: str) -> None:
    kinds = [KINDS[struct]] if KINDS[struct] else ["completion", "chat"]
    for kind in kinds:
        CHECKS[(struct, field)](live, kind)
