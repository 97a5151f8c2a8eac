"""The pooling face: `/v1/embeddings` (OpenAI's), `/pooling`, `/score` and `/rerank` (vLLM's).

Runs in the API process (trio). Owns those routes' schemas and their replies.
"""
