"""Records and configuration every process reads: the device config, speculative decoding's,
the flag declarations, the wire records of a step, process plumbing, the node token and a
thread with a stack of its own.

Imported by the `trillm` parent, the API process, the engine and the workers alike, so it
imports nothing else of trillm and never loads torch (`tests/test_layering.py`). Its modules
are public: each is the one home of what it declares.
"""
