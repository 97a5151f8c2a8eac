"""Speculative decoding in the runner: n-gram and draft-model proposals, and their verification.

Runs in the worker. Owns rejection sampling, which keeps the target model's distribution
exactly, and the draft model run beside the target.
"""
