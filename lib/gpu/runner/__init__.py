"""The model runner: one `StepBatch` in, one forward pass and its sampled tokens out.

Runs wherever a worker runs (engine process at TP 1, a worker process above). Owns the
persistent per-request rows (`_input_batch`), the choice of forward path, CUDA graphs and their
static inputs, the host read-back of a step (`_ahead`, `_pinned`), pooling and prompt embeds.
"""
