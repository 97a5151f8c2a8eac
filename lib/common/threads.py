"""A thread with a stack of a given size, for native code that recurses with its input.

Both sides compile grammars (the frontend checks them, the engine builds them), and a compiler
recursing past the default 8 MiB stack is a SIGSEGV of the whole process. `threading.
stack_size` is process-wide, so it is set only while this starts its thread (under a lock) and
put back at once. The stack is reserved address space; only the pages a call touches become
memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_stack_size_lock = threading.Lock()


def start_thread(body: Callable[[], None], stack_bytes: int, name: str) -> threading.Thread:
    """Start `body` on a daemon thread whose stack is `stack_bytes` (the size applies only
    to this thread: the process-wide setting is restored before returning)."""
    with _stack_size_lock:
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=body, name=name, daemon=True)
            thread.start()  # the OS thread, and its stack, exist once start() returns
        finally:
            threading.stack_size(previous)
    return thread
