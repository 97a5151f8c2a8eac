"""The Responses store's byte bound: an entry counted by all it keeps, and the RSS it holds.

The counts are checked against tracemalloc (what CPython allocated for a decoded request's
messages) and the bound against the resident size of a process that fills a store with the
largest requests the server reads.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tracemalloc

import msgspec
import pytest

from trillm.http.edge._errors import RequestError
from trillm.http.openai._requests import ChatMessage, decode_request
from trillm.http.responses._api import ResponsesRequest, input_messages
from trillm.http.responses._store import (
    ResponseStore,
    StoredResponse,
    entry_bytes,
    held_bytes,
    str_bytes,
)

MiB = 1 << 20
BODY = b'{"id":"resp_1","object":"response"}'
TEXTS = {
    "ascii": "x" * 100_000,
    "latin-1": "café " * 20_000,
    "cjk": "中文" * 50_000,
    "ascii and one emoji": "x" * 100_000 + "\U0001f600",  # 4 bytes for every character
}


def test_an_entry_is_counted_by_its_messages_not_only_its_body() -> None:
    store = ResponseStore(16, max_bytes=8 * MiB)
    for i in range(8):  # 2 MiB of input each, a 35-byte body
        store.put(f"resp_{i}", StoredResponse(BODY, (ChatMessage("user", "x" * (2 * MiB)),)))
    assert len(store) == 3  # four are a little over 8 MiB
    assert 6 * MiB < store.num_bytes <= 8 * MiB
    with pytest.raises(RequestError, match="'resp_4' is stored: it was never stored"):
        store.get("resp_4")
    assert store.get("resp_7") == BODY


@pytest.mark.parametrize("kind", TEXTS)
def test_a_string_counts_its_width_and_its_utf8_copy_before_it_is_cached(kind: str) -> None:
    text = "".join(TEXTS[kind])  # a fresh string: none of its copies cached yet
    counted = str_bytes(text)
    msgspec.json.encode(text)  # caches the UTF-8 copy of a non-ASCII string
    assert counted == str_bytes(text) == sys.getsizeof(text)
    if kind == "ascii and one emoji":
        assert counted > 5 * len(text)  # its JSON is about one byte a character


def request_body(kind: str) -> bytes:
    """A Responses request of about 256 KiB: one long text, many short turns, or tool calls."""
    if kind in TEXTS:
        text = TEXTS[kind]
        items: list[dict[str, object]] = [
            {"role": "user", "content": text},
            {"role": "user", "content": [{"type": "input_text", "text": text[:999]}] * 3},
        ]
    elif kind == "short turns":
        items = [{"role": "user" if i % 2 else "assistant", "content": "hi"} for i in range(4000)]
    else:
        items = [
            item
            for i in range(1500)
            for item in (
                {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": f"c{i}", "output": f"{i} °C"},
            )
        ]
    return json.dumps({"model": "m", "input": items}, ensure_ascii=False).encode()


@pytest.mark.parametrize("kind", [*TEXTS, "short turns", "tool calls"])
def test_a_decoded_conversation_is_never_counted_under_what_it_allocated(kind: str) -> None:
    body = request_body(kind)
    input_messages(decode_request(body, ResponsesRequest).input)  # msgspec's decoder, built
    tracemalloc.start()
    try:
        messages = tuple(input_messages(decode_request(body, ResponsesRequest).input))
        msgspec.json.encode(messages)  # every non-ASCII string's UTF-8 copy, cached
        allocated = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    counted = held_bytes(messages)
    assert allocated - 1024 <= counted <= 2 * allocated  # (1 KiB: tracemalloc's own records)


def test_a_continued_conversation_counts_the_messages_it_shares_again() -> None:
    store = ResponseStore(4)
    first = (ChatMessage("user", "x" * 10_000), ChatMessage("assistant", "y"))
    second = (*first, ChatMessage("user", "z"))  # previous_response_id: the same objects
    one, two = StoredResponse(BODY, first), StoredResponse(BODY, second)
    store.put("resp_1", one)
    store.put("resp_2", two)
    assert entry_bytes("resp_2", two) > entry_bytes("resp_1", one) > 10_000
    assert store.num_bytes == entry_bytes("resp_1", one) + entry_bytes("resp_2", two)
    store.put("resp_2", one)  # a put again replaces its count
    store.delete("resp_1")
    assert store.num_bytes == entry_bytes("resp_2", one)
    store.delete("resp_2")
    assert store.num_bytes == 0


FILL = """
import json, sys
import msgspec
from trillm.http.openai._requests import decode_request
from trillm.http.responses._api import ResponsesRequest, input_messages
from trillm.http.responses._store import ResponseStore, StoredResponse

max_bytes, bound, body_bytes = (int(a) for a in sys.argv[1:])
def status(field):  # VmHWM, not ru_maxrss: that one is pytest's where it was larger
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith(field + ":"))
def rss():
    return status("VmRSS")
def request(i):  # the largest body the app reads, a text of each width in turn
    n = body_bytes - 64
    text = [b"x" * n, "中".encode() * (n // 3), b"x" * (n - 4) + "\\U0001f600".encode(),
            "café ".encode() * (n // 6)][i % 4]
    return b'{"model":"m","input":[{"role":"user","content":"' + text + b'"}]}'
store = ResponseStore(1024, max_bytes=max_bytes)
base = rss()
for i in range(48):  # the store fills about six times over
    messages = tuple(input_messages(decode_request(request(i), ResponsesRequest).input))
    msgspec.json.encode(messages)  # as sent on: the UTF-8 copies, cached
    store.put(f"resp_{i:032x}", StoredResponse(b'{"id":"resp_%d"}' % i, messages))
    del messages
    if rss() - base > bound or store.num_bytes > max_bytes:
        break  # an accounting that holds too much stops here, before it holds more
peak = status("VmHWM") - base
print(json.dumps({"puts": i + 1, "kept": len(store), "counted": store.num_bytes, "peak": peak}))
"""


@pytest.mark.skipif(
    not os.path.exists("/proc/self/status") or platform.libc_ver()[0] != "glibc",
    reason="reads /proc/self/status and sets glibc's malloc tunables",
)
@pytest.mark.parametrize(
    ("allocator", "times"), [("mmap threshold fixed", 1), ("glibc's defaults", 2)]
)
def test_a_full_store_holds_the_process_to_its_bound(allocator: str, times: int) -> None:
    """64 MiB of 4 MiB requests (each up to 20 MiB of strings) stay within `times` x 64 MiB
    of resident growth, plus 32 MiB for the request in hand (its body, its decoded text).

    With glibc's defaults, freed large strings' pages stay in the heap for reuse (1.7x
    measured); with the mmap threshold fixed at 128 KiB they go back, and the resident
    size follows the count.
    """
    max_bytes, body_bytes = 64 * MiB, 4 * MiB
    bound = times * max_bytes + 32 * MiB
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if allocator == "mmap threshold fixed":
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)
    args = [str(n) for n in (max_bytes, bound, body_bytes)]
    done = subprocess.run(
        [sys.executable, "-c", FILL, *args], env=env, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()
    filled = json.loads(done.stdout)
    assert filled["puts"] == 48, f"stopped over the bound: {filled}"
    assert filled["counted"] <= max_bytes and filled["kept"] >= 3
    assert filled["peak"] <= bound, f"{filled['peak'] / MiB:.0f} MiB > {bound / MiB:.0f} MiB"


def test_a_pinned_entry_is_never_evicted_and_the_bound_holds_once_unpinned() -> None:
    """A background response in progress is pinned: polling it never 404s while it runs,
    whatever else is stored meanwhile; once it ends, the store is back within its size."""
    store = ResponseStore(2)
    store.put("running", StoredResponse(b"{}", ()))
    store.pin("running")
    for name in ("b", "c", "d"):
        store.put(name, StoredResponse(b"{}", ()))
    assert store.get("running") == b"{}" and store.get("d") == b"{}"
    assert len(store) == 2  # "b" and "c" went, oldest first, around the pin
    store.pin("d")
    store.put("e", StoredResponse(b"{}", ()))  # both others pinned: over the size a while
    assert len(store) == 3
    store.unpin("running")  # its run ended: its result is kept, the oldest other goes
    assert len(store) == 2 and store.get("running") == b"{}"
    with pytest.raises(RequestError, match="no response 'e' is stored"):
        store.get("e")
