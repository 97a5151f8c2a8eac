#!/usr/bin/env bash
# shellcheck disable=SC2317  # the part functions run through `part NAME LIMIT_S FUNCTION`
# The one prepared check for a lent GPU machine (an H200): tests, a model benchmark, a server.
#
#   bash perf/gpu_check.sh [--dry-run]        OUT=DIR (default ./gpu-check-out)
#   on the device: run(command="bash perf/gpu_check.sh", carry=[".whl"], timeout_s=540),
#   after `make gpu-wheels` here (the wheels the machine lacks, and SmolLM2's tokenizer).
#
# Parts, in order; each is bounded in time, recorded, and run whatever the others did:
#   setup   pip install .whl/*.whl into a temporary --target (no index, no deps), trillm = lib/
#           there; an import check of what the parts need; the device (CUDA is required)
#   pytest  pytest -m gpu tests/gpu: tests/gpu/test_cuda.py and any other gpu-marked test
#   bench   perf/gpu_bench.py: decode eager vs CUDA graphs against the roofline, prefill TFLOP/s
#   serve   perf/_gpu_serve.py: trillm serve of a dummy 1B-shaped model under bench_serve.py at
#           concurrency 1 and 64 (TTFT, TPOT, output tok/s, GPU busy fraction)
# --dry-run installs nothing and runs on CPU: the gpu tests collected (they skip), gpu_bench.py
# and the serve part on tiny models. Everything ends within BUDGET_S: 7.75 minutes (4 dry).
#
# Writes $OUT/gpu_check.json (every part's status and results), $OUT/summary.txt and one log
# per part: six files (the device returns eight at most). Exits 0 when every part passed.
set -u -o pipefail

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h | --help) sed -n '3,/^set /p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg'; give --dry-run or nothing" >&2; exit 2 ;;
  esac
done

BUDGET_S=$((DRY_RUN ? 240 : 465))
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
DRY_FLAG=()
[ "$DRY_RUN" = 1 ] && DRY_FLAG=(--dry-run)
rm -f "$OUT"/gpu_check.json "$OUT"/summary.txt "$OUT"/{setup,pytest,bench,serve}.log
: >"$WORK/parts.tsv"
FAILED=0

# The import check: what the parts import, the versions, and the device, into env.json.
IMPORT_CHECK=$(
  cat <<'EOF'
import importlib, json, subprocess, sys
path, dry = sys.argv[1], sys.argv[2] == "1"
needed = [
    "numpy", "torch", "triton", "transformers", "tokenizers", "safetensors", "gguf", "tqdm",
    "trio", "outcome", "sniffio", "msgspec", "posix_ipc", "hypercorn", "h2", "wsproto",
    "llguidance", "prometheus_client", "httpx", "pytest", "pytest_trio", "pytest_timeout",
    "hypothesis", "trillm.cli", "trillm.http._server", "trillm.engine", "trillm.gpu",
]
versions, missing = {}, {}
for name in needed:
    try:
        versions[name] = getattr(importlib.import_module(name), "__version__", None)
    except Exception as exc:  # any failure to import is what this check reports
        missing[name] = f"{type(exc).__name__}: {exc}"
env = {"python": sys.version.split()[0], "executable": sys.executable, "versions": versions,
       "missing": missing, "cuda": False, "device": None, "nvidia_smi": None}
if "torch" in versions:
    import torch
    env["cuda"] = torch.cuda.is_available()
    env["device"] = torch.cuda.get_device_name() if env["cuda"] else "cpu"
try:
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    env["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.SubprocessError):
    pass
json.dump(env, open(path, "w"), indent=1)
print(json.dumps(env, indent=1))
problems = [f"cannot import {k}: {v}" for k, v in missing.items()]
if not dry and not env["cuda"]:
    problems.append("no CUDA device visible to torch (a dry run needs none: --dry-run)")
print("\n".join(problems) or "imports and device: ok")
sys.exit(1 if problems else 0)
EOF
)

# pytest's counts from its JUnit XML into pytest.json; a real run must pass some tests, a dry
# run must skip them all (a gpu test that runs on CPU is mis-marked).
PYTEST_COUNTS=$(
  cat <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
xml, path, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
try:
    suites = ET.parse(xml).getroot()
except (OSError, ET.ParseError) as exc:
    print(f"no pytest report ({exc}): pytest was killed or did not start")
    sys.exit(1)
suites = [suites] if suites.tag == "testsuite" else list(suites)
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
json.dump(n, open(path, "w"))
print(f"pytest: {n}")
bad = n["failures"] or n["errors"] or (n["passed"] if dry else not n["passed"])
if dry and not n["skipped"]:
    bad = True
sys.exit(1 if bad else 0)
EOF
)

# gpu_check.json and summary.txt from what the parts left in $WORK; run after every part, so
# a check cut short still reports the parts before.
REPORT=$(
  cat <<'EOF'
import json, sys
from pathlib import Path
work, out, dry, finished, seconds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1", int(sys.argv[5])
def load(name):
    try:
        return json.loads((work / name).read_text())
    except (OSError, ValueError):
        return None
parts = {}
for line in (work / "parts.tsv").read_text().splitlines():
    name, rc, secs, note = line.split("\t")
    parts[name] = {"ok": rc == "0", "rc": int(rc), "seconds": int(secs),
                   "timed_out": rc in ("124", "137"), "note": note, "log": f"{name}.log"}
ok = finished and len(parts) == 4 and all(p["ok"] for p in parts.values())
report = {"dry_run": dry, "finished": finished, "ok": ok, "seconds": seconds, "parts": parts,
          "env": load("env.json"), "pytest": load("pytest.json"), "bench": load("bench.json"),
          "serve": load("serve.json")}
(out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
env = report["env"] or {}
status = "PASS" if ok else ("FAIL" if finished else "RUNNING")
lines = [f"gpu_check{' --dry-run' if dry else ''} on {env.get('device') or '?'} "
         f"({env.get('nvidia_smi') or 'no nvidia-smi'}): {status} in {seconds} s"]
for name, p in parts.items():
    extra = " (timed out)" if p["timed_out"] else ""
    lines.append(f"  {name:<7} {'ok' if p['ok'] else 'FAILED':<6} rc {p['rc']:<3} {p['seconds']:>4} s{extra} {p['note']}")
if report["pytest"]:
    lines.append(f"pytest: {report['pytest']}")
lines += [f"cannot import {k}: {v}" for k, v in env.get("missing", {}).items()]
for name in ("bench", "serve"):
    if report[name]:
        lines += [""] + report[name].get("table", [])
(out / "summary.txt").write_text("\n".join(lines) + "\n")
if finished:
    print("\n".join(lines))
EOF
)

report() { # report FINISHED
  "$PYTHON" -c "$REPORT" "$WORK" "$OUT" "$DRY_RUN" "$1" "$SECONDS" || echo "gpu_check.sh: the report failed" >&2
}

limit() { # limit OWN_S: OWN_S, or less so that the whole check ends within BUDGET_S (>= 1)
  local left=$((BUDGET_S - SECONDS))
  left=$((left < $1 ? left : $1))
  echo $((left < 1 ? 1 : left))
}

part() { # part NAME OWN_S FUNCTION: run FUNCTION LIMIT_S with its output in NAME.log; record
  local name=$1 own=$2 fn=$3 started=$SECONDS rc=0 bound note=""
  bound=$(limit "$own")
  echo "== $name: at most $bound s"
  if [ "$bound" -lt 20 ]; then
    rc=124 note="skipped: under 20 s of the ${BUDGET_S} s budget left"
    echo "$note" >>"$OUT/$name.log"
  else
    "$fn" "$bound" >>"$OUT/$name.log" 2>&1 || rc=$?
  fi
  [ "$rc" -eq 0 ] || FAILED=1
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - started)) "$note" >>"$WORK/parts.tsv"
  echo "== $name: rc $rc after $((SECONDS - started)) s"
  report 0
}

setup() { # runs in this shell (no pipe), so its PYTHONPATH holds for the parts after it
  local bound=$1 rc=0 wheels=()
  if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: nothing installed; $PYTHON as it is"
  else
    local site=$WORK/site
    mkdir -p "$site"
    shopt -s nullglob
    wheels=(.whl/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -eq 0 ]; then
      echo "no wheels in .whl/: run 'make gpu-wheels' on the CPU machine and carry .whl" && rc=1
    else
      echo "installing ${#wheels[@]} wheels into $site"
      timeout -k 5 "$bound" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$site" "${wheels[@]}" || rc=1
    fi
    ln -sfn "$REPO/lib" "$site/trillm" # the package trillm is lib/ (pyproject's package-dir)
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  timeout -k 5 "$(limit 90)" "$PYTHON" -c "$IMPORT_CHECK" "$WORK/env.json" "$DRY_RUN" || rc=1
  return "$rc"
}

run_pytest() { # -v: a killed run's log still says which tests passed; the session timeout
  local bound=$1 rc=0 # (pytest-timeout) stops it in time to write its report
  timeout -k 10 "$bound" "$PYTHON" -m pytest -m gpu tests/gpu -v -rs --durations=10 \
    -p no:cacheprovider --continue-on-collection-errors --session-timeout=$((bound - 25)) \
    --junitxml="$WORK/pytest.xml" || rc=$?
  if ! "$PYTHON" -c "$PYTEST_COUNTS" "$WORK/pytest.xml" "$WORK/pytest.json" "$DRY_RUN"; then
    [ "$rc" -ne 0 ] || rc=1
  fi
  return "$rc"
}

run_bench() {
  timeout -k 10 "$1" "$PYTHON" perf/gpu_bench.py "${DRY_FLAG[@]}" --json "$WORK/bench.json"
}

run_serve() { # _gpu_serve.py stops its runs 30 s before the part's bound and reports
  timeout -k 10 "$1" "$PYTHON" perf/_gpu_serve.py "${DRY_FLAG[@]}" --json "$WORK/serve.json" \
    --deadline $(($1 - 30))
}

echo "gpu_check.sh$([ "$DRY_RUN" = 1 ] && echo ' --dry-run'): OUT=$OUT, python $PYTHON"
part setup 120 setup
part pytest 180 run_pytest
part bench 110 run_bench
part serve 180 run_serve
report 1
exit "$FAILED"
