"""The chat template's refusals and failures as `ChatTemplateError`, quoting the template:
from `AsyncLLM.apply_chat_template` and `AsyncLLM.chat` (nothing reaches the engine), and
from the input processor for a template that does not parse or a model that has none."""

from __future__ import annotations

from pathlib import Path

import pytest

from trillm.engine import EngineConfig, LLMConfig, open_llm
from trillm.engine.client import ChatTemplateError
from trillm.engine.client.inputs._input_processor import InputProcessor
from trillm.engine.client.inputs._tokenizer import load_tokenizer
from trillm.gpu import WorkerConfig

from ...gpu.conftest import save_tiny

# Gemma 2's refusal, as its template words it
NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] "
    "+ '<end_of_turn>\\n' }}{% endfor %}{{ '<start_of_turn>model\\n' }}"
)
SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Hello"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("chat-template-tiny"), "llama")


async def test_a_refusing_template_raises_chat_template_error_and_sends_nothing(
    tiny_dir: Path, tmp_path: Path
) -> None:
    template = tmp_path / "gemma2.jinja"
    template.write_text(NO_SYSTEM)
    worker = WorkerConfig(str(tiny_dir), device="cpu", dtype="float32", kv_cache_bytes=1 << 25)
    config = LLMConfig(
        EngineConfig(worker=worker), chat_template=str(template), start_timeout=120, in_process=True
    )
    refusal = "the chat template refused the messages: System role not supported"
    async with open_llm(config) as llm:
        with pytest.raises(ChatTemplateError, match=f"^{refusal}$"):
            llm.apply_chat_template([SYSTEM, USER])
        with pytest.raises(ChatTemplateError, match=f"^{refusal}$"):
            async with llm.chat([SYSTEM, USER]):
                pass
        assert llm.num_request_states == 0
        text = llm.tokenizer.decode(llm.apply_chat_template([USER]))
        assert text == "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
        assert not llm.errored


def test_a_template_that_does_not_parse_names_its_line(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_dir))
    template = "{% for m in messages %}\n{{ m['content'] }\n"
    inputs = InputProcessor(tokenizer, None, template)  # type: ignore[arg-type]
    with pytest.raises(
        ChatTemplateError,
        match=r"^the chat template could not render the messages: TemplateSyntaxError: "
        r"unexpected '}' \(line 2\)$",
    ):
        inputs.render_chat([USER])


def test_a_model_without_a_chat_template_says_how_to_give_one(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_dir))
    tokenizer.chat_template = None
    inputs = InputProcessor(tokenizer, None)  # type: ignore[arg-type]
    with pytest.raises(
        ChatTemplateError, match=r"^the model has no chat template \(.*\): give one with --chat"
    ):
        inputs.render_chat([USER])
