"""OpenAI's Responses API: `POST /v1/responses`, its typed events, the store and background runs.

Runs in the API process (trio). Owns the stored responses (in memory, bounded) and the runs
that outlive their request's connection.
"""
