"""LoRA adapters on the device: safe reads of their files, their weights, and the step's slots.

Runs in the worker. Owns which adapters are known, in host memory and in a device slot, and the
Punica-style shrink/expand over the slots.
"""
