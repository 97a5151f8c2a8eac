"""Each model family's own chat template, served: a conversation it accepts is a 200 on the
prompt it renders; one it refuses (its `raise_exception`) is a 400 quoting its words, for a
stream too and for `/tokenize`; a template that breaks on the messages is a 400 naming why.

The templates are the Jinja the families ship, in `tokenizer_config.json` or in
`chat_template.jinja`, over SmolLM2's tokenizer: its BOS and EOS (`<|im_start|>`,
`<|im_end|>`) stand in for each family's, and the families' own special tokens are text. The
families run on the in-process app (the real `App` and `AsyncLLM`, an in-process engine, no
socket) so that each gets its own tokenizer in well under a second; one test drives a real
server with `--chat-template` through the openai SDK.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from trillm.engine import EngineConfig, LLMConfig, open_llm
from trillm.gpu import WorkerConfig
from trillm.http.edge._app import App
from trillm.http.edge._config import ServeConfig
from trillm.http.metrics._metrics import Metrics

from .conftest import start_server

BOS, EOS = "<|im_start|>", "<|im_end|>"  # SmolLM2's bos_token and eos_token
DATE = "{date}"  # where a template writes strftime_now's date (any one line)

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Hello"}
ASSISTANT = {"role": "assistant", "content": "Hi there"}
TURNS = [USER, ASSISTANT, {"role": "user", "content": "How are you?"}]
ALTERNATES = "Conversation roles must alternate user/assistant/user/assistant/..."

# google/gemma-2-2b-it
GEMMA2 = r"""{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"""  # noqa: E501

# google/gemma-3-4b-it: the system turn folds into the first user turn
GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Qwen/Qwen3-8B, with the no-user-query check of the 2507 releases
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501

# microsoft/Phi-3-mini-4k-instruct
PHI3 = r"""{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"""  # noqa: E501

# microsoft/phi-4
PHI4 = r"""{% for message in messages %}{% if (message['role'] == 'system') %}{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'assistant') %}{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"""  # noqa: E501

# allenai/OLMo-2-1124-7B-Instruct
OLMO2 = r"""{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}"""  # noqa: E501

# ibm-granite/granite-3.1-8b-instruct: a dated default system turn (strftime_now)
GRANITE = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "Knowledge Cutoff Date: April 2024.\nToday's Date: " + strftime_now('%B %d, %Y') + ".\nYou are Granite, developed by IBM." %}
    {%- if tools and documents %}
        {%- set system_message = system_message + " You are a helpful AI assistant with access to the following tools. When a tool is required to answer the user's query, respond with <|tool_call|> followed by a JSON list of tools used. If a tool does not exist in the provided list of tools, notify the user that you do not have the ability to fulfill the request.\n\nWrite the response to the user's input by strictly aligning with the facts in the provided documents. If the information needed to answer the question is not available in the documents, inform the user that the question cannot be answered based on the available data." %}
    {%- elif tools %}
        {%- set system_message = system_message + " You are a helpful AI assistant with access to the following tools. When a tool is required to answer the user's query, respond with <|tool_call|> followed by a JSON list of tools used. If a tool does not exist in the provided list of tools, notify the user that you do not have the ability to fulfill the request." %}
    {%- elif documents %}
        {%- set system_message = system_message + " Write the response to the user's input by strictly aligning with the facts in the provided documents. If the information needed to answer the question is not available in the documents, inform the user that the question cannot be answered based on the available data." %}
    {%- else %}
        {%- set system_message = system_message + " You are a helpful AI assistant." %}
    {%- endif %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\n' }}
{%- if tools %}
    {{- '<|start_of_role|>tools<|end_of_role|>' }}
    {{- tools | tojson(indent=4) }}
    {{- '<|end_of_text|>\n' }}
{%- endif %}
{%- if documents %}
    {{- '<|start_of_role|>documents<|end_of_role|>' }}
    {%- for document in documents %}
        {{- 'Document ' + loop.index0 | string + '\n' }}
        {{- document['text'] }}
        {%- if not loop.last %}
            {{- '\n\n'}}
        {%- endif%}
    {%- endfor %}
    {{- '<|end_of_text|>\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}
    {%- if loop.last and add_generation_prompt %}
        {{- '<|start_of_role|>assistant<|end_of_role|>' }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501

# HuggingFaceTB/SmolLM3-3B's chat_template.jinja (its long /think instructions cut short, its
# python_tools branch left out): /think and /no_think in the system turn, a dated metadata
# header, `{% generation %}` (transformers' own Jinja extension)
SMOLLM3 = r"""{# ───── defaults ───── #}
{%- if enable_thinking is not defined -%}
{%- set enable_thinking = true -%}
{%- endif -%}

{# ───── reasoning mode ───── #}
{%- if enable_thinking -%}
  {%- set reasoning_mode = "/think" -%}
{%- else -%}
  {%- set reasoning_mode = "/no_think" -%}
{%- endif -%}

{# ───── header (system message) ───── #}
{{- "<|im_start|>system\n" -}}

{%- if messages[0].role == "system" -%}
  {%- set system_message = messages[0].content -%}
  {%- if "/no_think" in system_message -%}
    {%- set reasoning_mode = "/no_think" -%}
  {%- elif "/think" in system_message -%}
    {%- set reasoning_mode = "/think" -%}
  {%- endif -%}
  {%- set custom_instructions = system_message.replace("/no_think", "").replace("/think", "").rstrip() -%}
{%- endif -%}

{%- if "/system_override" in system_message -%}
  {{- custom_instructions.replace("/system_override", "").rstrip() -}}
  {{- "<|im_end|>\n" -}}
{%- else -%}
  {{- "## Metadata\n\n" -}}
  {{- "Knowledge Cutoff Date: June 2025\n" -}}
  {%- set today = strftime_now("%d %B %Y") -%}
  {{- "Today Date: " ~ today ~ "\n" -}}
  {{- "Reasoning Mode: " + reasoning_mode + "\n\n" -}}

  {{- "## Custom Instructions\n\n" -}}
  {%- if custom_instructions -%}
    {{- custom_instructions + "\n\n" -}}
  {%- elif reasoning_mode == "/think" -%}
    {{- "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role as an assistant involves thoroughly exploring questions through a systematic thinking process before providing the final precise and accurate solutions.\n\n" -}}
  {%- else -%}
    {{- "You are a helpful AI assistant named SmolLM, trained by Hugging Face.\n\n" -}}
  {%- endif -%}

  {%- if xml_tools or python_tools or tools -%}
    {{- "### Tools\n\n" -}}
    {%- if xml_tools or tools -%}
      {%- if tools -%}
        {%- set xml_tools = tools -%}
      {%- endif -%}
      {%- set ns = namespace(xml_tool_string="You may call one or more functions to assist with the user query.\nYou are provided with function signatures within <tools></tools> XML tags:\n\n<tools>\n") -%}
      {%- for tool in xml_tools[:] -%} {# The slicing makes sure that xml_tools is a list #}
        {%- set ns.xml_tool_string = ns.xml_tool_string ~ (tool | string) ~ "\n" -%}
      {%- endfor -%}
      {%- set xml_tool_string = ns.xml_tool_string + "</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" -%}
      {{- xml_tool_string -}}
    {%- endif -%}
    {{- "\n\n" -}}
  {%- endif -%}
  {{- "<|im_end|>\n" -}}
{%- endif -%}
{# ───── main loop ───── #}
{%- for message in messages -%}
    {%- set content = message.content if message.content is string else "" -%}
    {%- if message.role == "user" -%}
        {{ "<|im_start|>" + message.role + "\n"  + content + "<|im_end|>\n" }}
    {%- elif message.role == "assistant" -%}
        {% generation %}
        {%- if reasoning_mode == "/think" -%}
            {{ "<|im_start|>assistant\n" + content.lstrip("\n") + "<|im_end|>\n" }}
        {%- else -%}
            {{ "<|im_start|>assistant\n" + "<think>\n\n</think>\n" + content.lstrip("\n") + "<|im_end|>\n" }}
        {%- endif -%}
        {% endgeneration %}
    {%- elif message.role == "tool" -%}
    {{ "<|im_start|>" + "user\n"  + content + "<|im_end|>\n" }}
    {%- endif -%}
{%- endfor -%}
{# ───── generation prompt ───── #}
{%- if add_generation_prompt -%}
    {%- if reasoning_mode == "/think" -%}
        {{ "<|im_start|>assistant\n" }}
    {%- else -%}
        {{ "<|im_start|>assistant\n" + "<think>\n\n</think>\n" }}
    {%- endif -%}
{%- endif -%}
"""  # noqa: E501

# mistralai/Mixtral-8x7B-Instruct-v0.1 (Mistral-7B-Instruct-v0.1's too)
MIXTRAL = r"""{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"""  # noqa: E501


@dataclass(frozen=True)
class Family:
    """A family's template, a conversation it accepts with the prompt it renders, and one it
    refuses with the words of its `raise_exception`."""

    name: str
    template: str
    accepted: list[dict[str, str]]
    prompt: str  # the rendered text; DATE stands for a date
    refused: list[dict[str, str]] | None = None
    refusal: str = ""
    in_jinja_file: bool = False  # shipped as chat_template.jinja (it wins over the config's)


FAMILIES = [
    Family(
        "gemma2",
        GEMMA2,
        TURNS,
        f"{BOS}<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\nHi there"
        "<end_of_turn>\n<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n",
        [SYSTEM, USER],
        "System role not supported",
    ),
    Family(
        "gemma3",
        GEMMA3,
        [SYSTEM, USER],
        f"{BOS}<start_of_turn>user\nBe brief.\n\nHello<end_of_turn>\n<start_of_turn>model\n",
        [USER, USER],
        ALTERNATES,
    ),
    Family(
        "qwen3",
        QWEN3,
        [
            SYSTEM,
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
            {"role": "user", "content": "And 3+3?"},
        ],
        # an earlier turn's reasoning is dropped; thinking is on (no enable_thinking)
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n",
        [SYSTEM],
        "No user query found in messages.",
    ),
    Family(
        "phi3",
        PHI3,
        [SYSTEM, USER],
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\n",
    ),
    Family(
        "phi4",
        PHI4,
        [SYSTEM, USER],
        "<|im_start|>system<|im_sep|>Be brief.<|im_end|><|im_start|>user<|im_sep|>Hello"
        "<|im_end|><|im_start|>assistant<|im_sep|>",
    ),
    Family(
        "olmo2",
        OLMO2,
        TURNS,
        f"{BOS}<|user|>\nHello\n<|assistant|>\nHi there{EOS}\n<|user|>\nHow are you?\n"
        "<|assistant|>\n",
    ),
    Family(
        "granite",
        GRANITE,
        [USER],
        "<|start_of_role|>system<|end_of_role|>Knowledge Cutoff Date: April 2024.\nToday's "
        f"Date: {DATE}.\nYou are Granite, developed by IBM. You are a helpful AI assistant."
        "<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Hello<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>",
    ),
    Family(
        "smollm3",
        SMOLLM3,
        [{"role": "system", "content": "Be brief. /no_think"}, *TURNS],
        "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\n"
        f"Today Date: {DATE}\nReasoning Mode: /no_think\n\n## Custom Instructions\n\n"
        "Be brief.\n\n<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\nHi there<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n",
        in_jinja_file=True,
    ),
    Family(
        "mixtral",
        MIXTRAL,
        TURNS,
        f"{BOS}[INST] Hello [/INST]Hi there{EOS}[INST] How are you? [/INST]",
        [SYSTEM, USER],
        ALTERNATES,
    ),
]

# Templates that break on a plain conversation: written for content parts only (Gemma 3's
# without its `is string` branch), and one that adds a number to a string.
BROKEN = [
    (
        "{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\\n' + "
        "message['content'][0]['text'] + '<end_of_turn>\\n' }}{% endfor %}",
        "UndefinedError: 'str object' has no attribute 'text'",
    ),
    (
        "{% for message in messages %}{{ loop.index + '. ' + message['content'] }}{% endfor %}",
        "TypeError: unsupported operand type(s) for +: 'int' and 'str'",
    ),
]


def messages_error(message: str) -> dict[str, Any]:
    """The OpenAI error object of a 400 about the messages."""
    return {"message": message, "type": "invalid_request_error", "param": "messages", "code": None}


def refused(words: str) -> dict[str, Any]:
    """The error object of a conversation the template refused with `words`."""
    return messages_error(f"the chat template refused the messages: {words}")


def tokenizer_dir(model: Path, path: Path, template: str, in_jinja_file: bool = False) -> Path:
    """The tiny model's tokenizer files with `template` as the chat template, in the
    tokenizer config or next to it as chat_template.jinja."""
    path.mkdir()
    shutil.copy(model / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((model / "tokenizer_config.json").read_text())
    if in_jinja_file:  # the config keeps SmolLM2's template: the file must win over it
        (path / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@asynccontextmanager
async def app_client(model: Path, tokenizer: Path) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client of the real `App` over an in-process engine of `model`, which reads
    the tokenizer (and its chat template) in `tokenizer`."""
    worker = WorkerConfig(str(model), device="cpu", dtype="float32", kv_cache_bytes=1 << 25)
    config = LLMConfig(
        EngineConfig(worker=worker), tokenizer=str(tokenizer), start_timeout=120, in_process=True
    )
    async with open_llm(config) as llm:
        app = App(llm, ServeConfig("tiny"), Metrics("tiny"))
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://tiny") as client:
            yield client
        assert not llm.errored


def chat(messages: list[dict[str, str]], *, stream: bool = False) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": 2, "ignore_eos": True, "stream": stream}


def assert_rendered(text: str, prompt: str) -> None:
    pattern = re.escape(prompt).replace(re.escape(DATE), r"[^\n]+")
    assert re.fullmatch(pattern, text), f"{text!r} is not {prompt!r}"


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
async def test_a_familys_template_serves_what_it_accepts_and_400s_what_it_refuses(
    family: Family, tiny_model: Path, tmp_path: Path
) -> None:
    tokenizer = tokenizer_dir(tiny_model, tmp_path / "tok", family.template, family.in_jinja_file)
    async with app_client(tiny_model, tokenizer) as client:
        if family.refused is not None:  # first: the refusals leave the server serving
            for path, body in [
                ("/v1/chat/completions", chat(family.refused)),
                ("/v1/chat/completions", chat(family.refused, stream=True)),
                ("/tokenize", {"messages": family.refused}),
            ]:
                r = await client.post(path, json=body)
                assert r.status_code == 400, r.text
                assert r.headers["content-type"] == "application/json"
                assert r.json() == {"error": refused(family.refusal)}
        tokens = (await client.post("/tokenize", json={"messages": family.accepted})).json()
        text = (await client.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
        assert_rendered(text["prompt"], family.prompt)
        r = await client.post("/v1/chat/completions", json=chat(family.accepted))
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]  # the prompt /tokenize showed
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (tokens["count"], 2)
        r = await client.post("/v1/chat/completions", json=chat(family.accepted, stream=True))
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text


@pytest.mark.parametrize(("template", "cause"), BROKEN, ids=["undefined", "type-error"])
async def test_a_template_that_breaks_on_the_messages_is_a_400_naming_the_cause(
    template: str, cause: str, tiny_model: Path, tmp_path: Path
) -> None:
    tokenizer = tokenizer_dir(tiny_model, tmp_path / "tok", template)
    async with app_client(tiny_model, tokenizer) as client:
        for path, body in [
            ("/v1/chat/completions", chat([USER])),
            ("/v1/chat/completions", chat([USER], stream=True)),
            ("/tokenize", {"messages": [USER]}),
        ]:
            r = await client.post(path, json=body)
            assert r.status_code == 400, r.text
            message = f"the chat template could not render the messages: {cause}"
            assert r.json() == {"error": messages_error(message)}
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text  # only chat needs the template


@pytest.mark.slow
def test_the_server_answers_gemma2s_system_refusal_with_400_and_serves_on(
    tiny_model: Path, tmp_path: Path
) -> None:
    template = tmp_path / "gemma2.jinja"
    template.write_text(GEMMA2)
    server = start_server(tiny_model, "--chat-template", str(template))
    try:
        sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                sdk.chat.completions.create(
                    model="tiny",
                    messages=[SYSTEM, USER],  # type: ignore[list-item]
                    max_tokens=2,
                    stream=stream,
                )
            assert info.value.status_code == 400
            assert info.value.body == refused("System role not supported")
        reply = sdk.chat.completions.create(
            model="tiny",
            messages=[USER],  # type: ignore[list-item]
            max_tokens=2,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].finish_reason == "length"
        assert httpx.get(f"{server.base_url}/health").status_code == 200
    finally:
        assert server.stop() == 0


# A template that reads variables, as Qwen3's reads enable_thinking and gpt-oss's its effort.
VARIABLES = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if reasoning_effort is defined %}effort: {{ reasoning_effort }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


async def test_template_variables_render_as_transformers_renders_them(
    tiny_model: Path, tmp_path: Path
) -> None:
    """chat_template_kwargs and reasoning_effort reach the template: the prompt served is the
    one transformers' own apply_chat_template renders with the same variables."""
    from transformers import AutoTokenizer

    tokenizer = tokenizer_dir(tiny_model, tmp_path / "tok", VARIABLES)
    oracle = AutoTokenizer.from_pretrained(tokenizer)
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({}, {}),
        ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
        ({"reasoning_effort": "high"}, {"reasoning_effort": "high"}),
    ]
    async with app_client(tiny_model, tokenizer) as client:
        for fields, variables in cases:
            expected = oracle.apply_chat_template(
                [USER], tokenize=True, add_generation_prompt=True, **variables
            )["input_ids"]
            body = {"messages": [USER], **fields}
            tokens = (await client.post("/tokenize", json=body)).json()
            if "reasoning_effort" not in fields:  # /tokenize takes the kwargs alone
                assert tokens["tokens"] == expected, fields
            r = await client.post("/v1/chat/completions", json={**chat([USER]), **fields})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(expected), fields
        bare = {"messages": [USER], "add_generation_prompt": False}
        tokens = (await client.post("/tokenize", json=bare)).json()["tokens"]
        assert (
            tokens == oracle.apply_chat_template([USER], add_generation_prompt=False)["input_ids"]
        )
        for fields, param in [
            (
                {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
                "chat_template_kwargs.chat_template",
            ),
            ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
            ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ]:
            r = await client.post("/v1/chat/completions", json={**chat([USER]), **fields})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"].startswith(param), r.text
