"""Device side: model runner, worker, paged attention, sampler, weight loaders.

Knows no scheduling policy and nothing of the engine or HTTP (DESIGN.md §1, §7). Filled in by
the model-runner issue.
"""
