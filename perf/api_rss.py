"""How lean the API process is: its import time, and its RSS serving a model.

    python perf/api_rss.py [--model DIR] [--repeats 5]

Prints, as JSON: the median wall time of `import trillm.http` in a fresh interpreter, that
interpreter's peak RSS, whether torch was loaded, and the RSS of a running `trillm serve`
API process (its engine is a child, not counted) at idle after one completion and one chat
request, with the shared-memory rings it maps (they count in its RSS, and in the engine's).
The model is a tiny random Llama built here unless --model is given. To compare with an
older tree, run the same script with PYTHONPATH pointing at a directory whose `trillm` is that
tree's `lib/` (a symlink).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from compare import serving  # perf/ is scripts: the ones next to this
from host_overhead import children, free_port

# VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over exec from the parent, so a
# child of a process that imported torch would report torch's size.
IMPORT = (
    "import sys, time\n"
    "t = time.perf_counter()\n"
    "import trillm.http\n"
    "import trillm.http.server._server\n"
    "seconds = time.perf_counter() - t\n"
    "hwm = next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
    "print(seconds, hwm, 'torch' in sys.modules)\n"
)


def import_figures(repeats: int) -> dict[str, object]:
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True)
        seconds, rss_kib, torch = out.stdout.split()
        runs.append((float(seconds), int(rss_kib), torch == "True"))
    return {
        "import_s_median": round(statistics.median(r[0] for r in runs), 3),
        "import_peak_rss_mib": round(max(r[1] for r in runs) / 1024, 1),
        "import_loads_torch": any(r[2] for r in runs),
    }


def status_mib(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def served_figures(model: Path, log: Path) -> dict[str, object]:
    port = free_port()
    argv = [
        sys.executable, "-m", "trillm.cli", "serve", str(model), "--port", str(port),
        "--served-model-name", "m", "--dtype", "float32", "--max-api-restarts", "0",
        "--kv-cache-memory-bytes", str(1 << 25),
    ]  # fmt: skip
    with serving("trillm", argv, port, log) as base:
        (api,) = children(os.getpid())  # unsupervised: the process started is the API server
        body = {"model": "m", "prompt": "hello", "max_tokens": 4}
        httpx.post(f"{base}/v1/completions", json=body, timeout=60).raise_for_status()
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60).raise_for_status()
        time.sleep(1.0)
        with open(f"/proc/{api}/maps") as f:
            torch_mapped = any("libtorch" in line for line in f)
        return {
            "api_rss_mib": round(status_mib(api, "VmRSS"), 1),
            "api_rss_shmem_mib": round(status_mib(api, "RssShmem"), 1),
            "api_maps_libtorch": torch_mapped,
        }


def tiny_model(path: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer (as the tests build), made once."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.gpu.conftest import save_tiny

    return save_tiny(path, "llama")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: a tiny Llama)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    figures: dict[str, object] = {"trillm": os.path.dirname(__import__("trillm").__file__)}
    figures |= import_figures(args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_model(Path(tmp))
        figures |= served_figures(model, Path(tmp) / "serve.log")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
