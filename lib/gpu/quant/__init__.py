"""Weight-only quantized linears, and GGUF's blocks kept compact on the device.

Runs in the worker. Owns the block layouts, their dequantisers and the choice of a quantized
kernel.
"""
