"""Stream a chat reply from the built-in SmolLM2-135M-Instruct with trillm's trio client.

.venv/bin/python examples/stream_chat.py "What is the capital of France?"
"""

from __future__ import annotations

import sys

import trio

import trillm


async def main(question: str) -> str:
    model = str(trillm.default_model_dir())
    config = trillm.LLMConfig(trillm.EngineConfig(worker=trillm.WorkerConfig(model)))
    params = trillm.SamplingParams(temperature=0.0, max_tokens=40)
    reply = []
    async with trillm.open_llm(config) as llm:
        messages = [{"role": "user", "content": question}]
        async with llm.chat(messages, params) as stream:
            async for output in stream:
                print(output.text, end="", flush=True)
                reply.append(output.text)
    print()
    return "".join(reply)


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "What is the capital of France?")
