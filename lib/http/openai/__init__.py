"""The OpenAI face: chat completions, completions and models, their schemas and their stream.

Runs in the API process (trio). Owns OpenAI's request and response bodies as msgspec Structs,
their mapping to `SamplingParams`, the SSE chunker and vLLM's additions to those bodies.
"""
