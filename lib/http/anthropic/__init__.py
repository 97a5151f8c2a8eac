"""Anthropic's Messages API: `POST /v1/messages` and `count_tokens`, its schema and its stream.

Runs in the API process (trio).
"""
