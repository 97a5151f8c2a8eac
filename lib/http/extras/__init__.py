"""vLLM's routes beyond OpenAI's: tokenize, LoRA loading, `/invocations`, chat batches, dev routes.

Runs in the API process (trio).
"""
