"""The frontend's engines: one client per engine process, its rings, launch, watchdog and restarts.

Runs in the API process (trio; `_sync_client` on a plain thread for `trillm.LLM`). Owns each
engine's process handle, pidfd and pump, the data-parallel router, the restart bound and the
resumption of a dead engine's requests on its successor.
"""
