"""From a step's logits to its tokens and logprobs, vectorised over the batch.

Runs in the worker. Owns each request's sampling state across steps, the per-step batch of
sampling columns and the grammar bitmask applied before sampling.
"""
