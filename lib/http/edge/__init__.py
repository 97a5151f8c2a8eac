"""The route table and what every route does at its edge: admit, decode, fail with OpenAI's body.

Runs in the API process (trio). Owns the ASGI application, admission by work, the
data-parallel rank a request is pinned to, the offload of large decoding and the one error type.
"""
