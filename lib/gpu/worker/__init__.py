"""One tensor-parallel rank: its device, process group, model runner and KV cache budget.

Runs in the engine process at TP 1 and in one worker process per rank above it
(`_worker_process`, driven through shared-memory rings). Owns the rank's start-up log, how it
reports its own death (`_failure`), and what "auto" in a `WorkerConfig` means on its device.
"""
