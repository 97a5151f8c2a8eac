"""Output processing: one pass over a STEP record's columns, detokenisation, what streams yield.

Runs in the API process (trio). Owns the table of open requests and each one's detokeniser,
stop strings and mailbox, and the shapes `LLM.generate` / `LLM.embed` return.
"""
