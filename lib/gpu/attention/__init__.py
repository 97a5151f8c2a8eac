"""Paged attention over a flattened mixed batch, behind one interface, and its backends.

Runs in the worker. Owns the torch (SDPA) path and the Triton backend with its kernels; the
CPU's C attention lives in `gpu/cpu` with the rest of the C step.
"""
