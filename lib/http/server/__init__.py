"""The API process's server: `trio.run`, hypercorn over owned TCP connections, the API key.

Runs in the API process (trio). Owns the listening socket's use, each connection's bounded
writes and the engine supervisor's nursery beside hypercorn.
"""
