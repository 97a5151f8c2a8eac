"""Engine: scheduler, KV-cache manager, busy loop, executors and the trio frontend client.

Knows nothing of HTTP (DESIGN.md §1, §6, §8). Filled in by the engine-core and frontend issues.
"""
