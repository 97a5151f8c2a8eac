"""Executors: how the engine runs a step on its workers, in process (TP 1) or one process a rank.

Runs in the engine process. Owns the worker processes it spawns, their broadcast ring and the
ranks' supervision (local, or on another node through `nodes`).
"""
