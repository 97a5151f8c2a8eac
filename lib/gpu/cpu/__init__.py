"""The CPU backend: the decode step in C (`csrc/`), its tiles, oneDNN linears and C element ops.

Runs in the worker when the device is the CPU. Owns the native build (`_native`), the tiled
weight layout, the measured choice between the C step and the torch forward (`_decode_probe`,
`_decode_paths`) and the prompts' linears on the tiles.
"""
