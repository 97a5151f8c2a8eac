"""trillm: an LLM inference server on trio and shared-memory rings."""

__version__ = "0.1.0"
