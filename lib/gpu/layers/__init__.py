"""The decoder's building blocks: tensor-parallel linears, norms, rotary, mixture of experts.

Runs in the worker (engine process at TP 1). Owns the tensor-parallel shard math
(`_parallel`) and the fused Triton kernels of the CUDA decode step; models are built from these.
"""
