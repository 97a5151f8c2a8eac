"""Prometheus metrics of the server, named as vLLM's, speculative decoding's among them.

Runs in the API process (trio). Owns the registry `/metrics` serves and vLLM's names over it.
"""
