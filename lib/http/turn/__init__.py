"""The shared turn code every face runs: inputs, constraints, tool and reasoning parsers, usage.

Runs in the API process (trio). Owns the generation service the faces call, one assistant turn
as ordered blocks, the tool-call formats and the grammar their fields make together.
"""
