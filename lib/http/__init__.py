"""OpenAI-compatible HTTP face over the engine's `AsyncLLM` (DESIGN.md §9).

Filled in by the HTTP-server issue.
"""
