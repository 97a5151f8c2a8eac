"""Continuous batching: which requests compute how many tokens each step, and what the step gave.

Runs in the engine process (its busy loop thread). Owns the waiting and running queues, each
request's engine-side copy, preemption, async scheduling and the drafts a step verifies.
"""
