"""Where a model's configuration and weights come from: safetensors directories, GGUF files.

Runs in the worker at start-up. Owns the GGUF reader and its translation to Hugging Face
configs.
"""
