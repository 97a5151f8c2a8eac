#!/usr/bin/env bash
# shellcheck disable=SC2317  # the part functions run through `part NAME LIMIT_S FUNCTION`
# The one prepared check for a lent GPU machine (an H200): tests, a model benchmark, a server.
#
#   bash perf/gpu_check.sh [--dry-run]        OUT=DIR (default ./gpu-check-out)
#   on the device: run(command="bash perf/gpu_check.sh", carry=[".whl"], timeout_s=420),
#   after `make gpu-wheels` here (the wheels the machine lacks, and SmolLM2's tokenizer).
#
# Parts, in order; each is bounded in time and recorded:
#   setup   pip install .whl/*.whl into a temporary --target (no index, no deps), trillm = lib/
#           there; /dev/shm (the rings need it: a tmpfs is mounted there when it is missing and
#           the check runs as root); an import check of what each part needs; the device
#   pytest  pytest -m gpu on the files that hold gpu-marked tests (test_cuda.py, ...)
#   bench   perf/gpu_bench.py: decode with CUDA graphs at 4 batch sizes, eager at batch 1,
#           against the roofline; prefill TFLOP/s; then --count-launches (kernels per step)
#   serve   perf/_gpu_serve.py: trillm serve of a dummy 1B-shaped model under bench_serve.py at
#           concurrency 1 and 64 (TTFT, TPOT, output tok/s, GPU busy fraction)
# Fail-fast: a part whose imports (or, on the device, CUDA) the setup found missing is skipped
# and its log and the summary say why. The deadline is checked before every part; the whole
# check ends within BUDGET_S (7 minutes; 5 dry). A part (or a serve run) skipped because too
# little time was left is a note, not a failure: it never turns written results into a
# failed check; nor does the launch count (best-effort, in what the bench part has left).
# SIGTERM or SIGINT stops the running part and still writes every result file.
# --dry-run installs nothing and runs on CPU: the imports checked, the gpu tests collected
# (they skip), gpu_bench.py and the serve part on tiny models. `make gpu-rehearsal` runs it in
# a venv of only the device image's packages and the carried wheels. PYTHON=... picks the
# interpreter; TOKENIZER_DIR=... SmolLM2's tokenizer for the serve part (default: .whl/).
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

BUDGET_S=${GPU_CHECK_BUDGET_S:-$((DRY_RUN ? 300 : 420))} # the variable: for tests
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
SITE=$WORK/site # the carried wheels (setup installs them) and trillm, linked to lib/
mkdir -p "$SITE" && ln -sfn "$REPO/lib" "$SITE/trillm" # trillm is lib/ (pyproject's package-dir)
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# The files that hold gpu-marked tests: collecting the rest of tests/gpu builds the C kernels
# and probes the CPU's, which the device needs no time for.
mapfile -t GPU_TESTS < <(grep -rlE 'pytest\.mark\.gpu\b' tests --include='test_*.py' | sort)
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
DRY_FLAG=()
[ "$DRY_RUN" = 1 ] && DRY_FLAG=(--dry-run)
TOKENIZER_FLAG=()
[ -n "${TOKENIZER_DIR:-}" ] && TOKENIZER_FLAG=(--tokenizer-dir "$TOKENIZER_DIR")
PARTS=(setup pytest bench serve)
rm -f "$OUT"/gpu_check.json "$OUT"/summary.txt "$OUT"/{setup,pytest,bench,serve}.log
: >"$WORK/parts.tsv"
FAILED=0

# The import check: what each part imports, the versions, and the device, into env.json; a
# part whose imports failed (or, on the device, that finds no CUDA) goes into blocked.tsv with
# why, and is skipped.
IMPORT_CHECK=$(
  cat <<'EOF'
import importlib, json, subprocess, sys
path, blocked_path, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
runtime = ["numpy", "torch", "triton", "transformers", "tokenizers", "safetensors", "gguf",
           "tqdm", "llguidance", "trio", "outcome", "sniffio", "msgspec", "posix_ipc"]
needs = {
    "pytest": [*runtime, "pytest", "pytest_trio", "pytest_timeout", "hypothesis", "trillm.gpu",
               "trillm.engine", "tests.conftest", "tests.gpu.conftest"],
    "bench": [*runtime, "trillm.gpu", "tests.gpu.driver"],
    "serve": [*runtime, "hypercorn", "h2", "wsproto", "prometheus_client", "httpx", "jinja2",
              "trillm.cli", "trillm.http", "trillm.engine"],
}
versions, missing = {}, {}
for name in dict.fromkeys(n for names in needs.values() for n in names):
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
blocked = {}
for part, names in needs.items():
    lacking = [n for n in names if n in missing]
    if lacking:
        blocked[part] = f"setup could not import {', '.join(lacking)}"
    elif not dry and not env["cuda"]:
        blocked[part] = "no CUDA device visible to torch (setup)"
env["blocked"] = blocked
json.dump(env, open(path, "w"), indent=1)
with open(blocked_path, "w") as f:
    f.writelines(f"{part}\t{why}\n" for part, why in blocked.items())
print(json.dumps(env, indent=1))
problems = [f"cannot import {k}: {v}" for k, v in missing.items()]
if not dry and not env["cuda"]:
    problems.append("no CUDA device visible to torch (a dry run needs none: --dry-run)")
problems += [f"{part} will be skipped: {why}" for part, why in blocked.items()]
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

# gpu_check.json and summary.txt from what the parts left in $WORK; run after every part (and
# on SIGTERM), so a check cut short still reports the parts before.
REPORT=$(
  cat <<'EOF'
import json, sys
from pathlib import Path
work, out, dry, finished, seconds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4], int(sys.argv[5])
names = sys.argv[6].split()
def load(name):
    try:
        return json.loads((work / name).read_text())
    except (OSError, ValueError):
        return None
parts = {}
for line in (work / "parts.tsv").read_text().splitlines():
    name, rc, secs, state, note = line.split("\t")
    parts[name] = {"ok": state in ("ok", "no time"), "rc": int(rc), "seconds": int(secs), "state": state,
                   "skipped": state == "skipped", "timed_out": state == "timed out",
                   "note": note, "log": f"{name}.log"}
interrupted = finished == "interrupted"
done = finished in ("1", "interrupted")
ok = finished == "1" and list(parts) == names and all(p["ok"] for p in parts.values())
report = {"dry_run": dry, "finished": done, "interrupted": interrupted, "ok": ok,
          "seconds": seconds, "parts": parts, "env": load("env.json"),
          "pytest": load("pytest.json"), "bench": load("bench.json"),
          "launches": load("launches.json"), "serve": load("serve.json")}
(out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
env = report["env"] or {}
status = "PASS" if ok else "INTERRUPTED" if interrupted else "FAIL" if done else "RUNNING"
short = [name for name, p in parts.items() if p["state"] == "no time"]
if ok and short:
    status += f" (skipped for time, no failure: {', '.join(short)})"
report["skipped_for_time"] = short
(out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
lines = [f"gpu_check{' --dry-run' if dry else ''} on {env.get('device') or '?'} "
         f"({env.get('nvidia_smi') or 'no nvidia-smi'}): {status} in {seconds} s"]
for name, p in parts.items():
    lines.append(f"  {name:<7} {p['state']:<11} rc {p['rc']:<3} {p['seconds']:>4} s  {p['note']}".rstrip())
if report["pytest"]:
    lines.append(f"pytest: {report['pytest']}")
lines += [f"cannot import {k}: {v}" for k, v in env.get("missing", {}).items()]
for name in ("bench", "launches", "serve"):
    if report[name]:
        lines += [""] + report[name].get("table", [])
(out / "summary.txt").write_text("\n".join(lines) + "\n")
if done:
    print("\n".join(lines))
EOF
)

report() { # report FINISHED: 0 (a part is next), 1 (all ran) or interrupted
  "$PYTHON" -c "$REPORT" "$WORK" "$OUT" "$DRY_RUN" "$1" "$SECONDS" "${PARTS[*]}" ||
    echo "gpu_check.sh: the report failed" >&2
}

limit() { # limit OWN_S: OWN_S, or less so that the whole check ends within BUDGET_S (>= 1)
  local left=$((BUDGET_S - SECONDS))
  left=$((left < $1 ? left : $1))
  echo $((left < 1 ? 1 : left))
}

record() { # record NAME RC STARTED STATE NOTE: one line of parts.tsv, and the report
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" $((SECONDS - $3)) "$4" "$5" >>"$WORK/parts.tsv"
  case $4 in ok | "no time") ;; *) FAILED=1 ;; esac
}

blocked_by() { # blocked_by NAME: why the setup blocked part NAME, or nothing
  [ "$1" = setup ] && return
  if [ ! -s "$WORK/env.json" ]; then
    echo "the setup's import check did not finish"
  elif [ -s "$WORK/blocked.tsv" ]; then
    awk -F'\t' -v part="$1" '$1 == part { print $2 }' "$WORK/blocked.tsv"
  fi
}

bounded() { # bounded S COMMAND...: COMMAND under `timeout` S (KILLed 10 s after); its pid
  timeout -k 10 "$@" & # goes into running.pids, so that a SIGTERM of the check reaches it
  echo $! >>"$WORK/running.pids"
  wait $!
}

RUNNING="" RUNNING_PID="" RUNNING_STARTED=0
part() { # part NAME OWN_S FUNCTION: FUNCTION LIMIT_S in the background, its output in
  local name=$1 own=$2 fn=$3 started=$SECONDS rc=0 bound state=ok note="" # NAME.log; record
  bound=$(limit "$own")
  if [ "$bound" -lt 20 ]; then # no time left is no failure of the part
    note="skipped for time: under 20 s of the ${BUDGET_S} s budget left" state="no time" rc=0
  else
    note=$(blocked_by "$name")
    [ -z "$note" ] || note="skipped: $note" state=skipped rc=0
  fi
  if [ -n "$note" ]; then
    echo "== $name: $note" | tee -a "$OUT/$name.log"
  else
    RUNNING=$name RUNNING_STARTED=$started
    : >"$WORK/running.pids"
    echo "== $name: at most $bound s"
    "$fn" "$bound" >>"$OUT/$name.log" 2>&1 & # in the background, so a SIGTERM is handled now
    RUNNING_PID=$!
    wait "$RUNNING_PID" || rc=$?
    RUNNING="" RUNNING_PID=""
    case $rc in 0) ;; 124 | 137) state="timed out" ;; *) state=failed ;; esac
    echo "== $name: $state (rc $rc) after $((SECONDS - started)) s"
  fi
  record "$name" "$rc" "$started" "$state" "$note"
  report 0
}

interrupted() { # on SIGTERM or SIGINT: stop the running part, record the rest, report, exit
  local signal=$1
  trap '' TERM INT
  echo "== gpu_check.sh: $signal after $SECONDS s; stopping ${RUNNING:-nothing} and reporting"
  if [ -n "$RUNNING" ]; then # the part's `timeout`s pass it on to their commands
    local pids pid
    mapfile -t pids <"$WORK/running.pids"
    kill -TERM "$RUNNING_PID" "${pids[@]}" 2>/dev/null
    for _ in $(seq 16); do # up to 8 s to write what they have (_gpu_serve.py writes at once)
      for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && break; pid=""; done
      [ -z "${pid:-}" ] && break
      sleep 0.5
    done
    echo "interrupted by $signal after $((SECONDS - RUNNING_STARTED)) s" >>"$OUT/$RUNNING.log"
    record "$RUNNING" 143 "$RUNNING_STARTED" interrupted "interrupted by $signal"
  fi
  local name
  for name in "${PARTS[@]}"; do
    if ! cut -f1 "$WORK/parts.tsv" | grep -qx "$name"; then
      echo "not run: the check was interrupted by $signal" >>"$OUT/$name.log"
      record "$name" 0 "$SECONDS" skipped "not run: interrupted by $signal"
    fi
  done
  report interrupted
  exit 143
}
trap 'interrupted SIGTERM' TERM
trap 'interrupted SIGINT' INT

shm_check() { # the rings' shared memory: /dev/shm a writable directory, or mount a tmpfs there
  if [ -d /dev/shm ] && [ -w /dev/shm ]; then
    echo "/dev/shm: $(df -h /dev/shm | awk 'NR == 2 { print $2 " " $1 ", " $4 " free" }')"
  elif [ "$(id -u)" = 0 ] && mkdir -p /dev/shm && mount -t tmpfs -o size=8g tmpfs /dev/shm; then
    echo "/dev/shm was missing or read-only: mounted an 8 GiB tmpfs there"
  else
    echo "/dev/shm is missing or not writable, and could not be mounted: the rings need it"
    return 1
  fi
}

setup() { # the wheels into $SITE (on the device), /dev/shm, then the import check
  local bound=$1 rc=0 wheels=()
  shm_check || rc=1
  if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: nothing installed; $PYTHON as it is, trillm from $SITE/trillm -> lib/"
  else
    shopt -s nullglob
    wheels=(.whl/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -eq 0 ]; then
      echo "no wheels in .whl/: run 'make gpu-wheels' on the CPU machine and carry .whl" && rc=1
    else
      echo "installing ${#wheels[@]} wheels into $SITE"
      bounded "$bound" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" || rc=1
    fi
  fi
  bounded "$(limit 90)" "$PYTHON" -c "$IMPORT_CHECK" "$WORK/env.json" "$WORK/blocked.tsv" \
    "$DRY_RUN" || rc=1
  return "$rc"
}

run_pytest() { # -v: a killed run's log still says which tests passed; the session timeout
  local bound=$1 rc=0 # (pytest-timeout) stops it in time to write its report
  echo "the files with gpu-marked tests: ${GPU_TESTS[*]}"
  bounded "$bound" "$PYTHON" -m pytest -m gpu "${GPU_TESTS[@]}" -v -rs --durations=10 \
    -p no:cacheprovider --continue-on-collection-errors --session-timeout=$((bound - 15)) \
    --junitxml="$WORK/pytest.xml" || rc=$?
  if ! "$PYTHON" -c "$PYTEST_COUNTS" "$WORK/pytest.xml" "$WORK/pytest.json" "$DRY_RUN"; then
    [ "$rc" -ne 0 ] || rc=1
  fi
  return "$rc"
}

run_bench() { # the benchmark, then the kernels per decode step in what is left of the bound:
  local started=$SECONDS rc=0 launches=0 # best-effort, its end a note, never the part's rc
  bounded "$1" "$PYTHON" perf/gpu_bench.py "${DRY_FLAG[@]}" --json "$WORK/bench.json" || rc=$?
  local left=$(($1 - (SECONDS - started) - 5))
  if [ "$left" -lt 30 ]; then
    echo "note: --count-launches skipped for time: ${left} s of the part's ${1} s left"
    return "$rc"
  fi
  bounded "$left" "$PYTHON" perf/gpu_bench.py "${DRY_FLAG[@]}" --count-launches \
    --json "$WORK/launches.json" || launches=$?
  [ "$launches" = 0 ] || echo "note: --count-launches ended with rc $launches (best-effort)"
  return "$rc"
}

run_serve() { # _gpu_serve.py ends its runs 15 s before the part's bound and reports; on the
  # bound's SIGTERM it writes what it has
  bounded "$1" "$PYTHON" perf/_gpu_serve.py "${DRY_FLAG[@]}" "${TOKENIZER_FLAG[@]}" \
    --json "$WORK/serve.json" --deadline $(($1 - 15))
}

echo "gpu_check.sh$([ "$DRY_RUN" = 1 ] && echo ' --dry-run'): OUT=$OUT, python $PYTHON"
part setup 90 setup
part pytest 180 run_pytest
part bench 120 run_bench
part serve 120 run_serve
report 1
exit "$FAILED"
