"""Request preparation: prompts to checked token ids, sampling parameters, constraints and budgets.

Runs in the API process (trio, and threads it offloads to). Owns the tokenizer, the checks a
request passes once before anything is sent (`PreparedRequest`), the grammar budgets measured
before llguidance sees a constraint, prompt embeddings and the LoRA names clients give.
"""
