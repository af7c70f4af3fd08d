#!/usr/bin/env bash
# The first run on an accelerator, in one command, with no package registry:
#   1. installs what the image lacks from the folder of scripts/device-wheels.sh only
#      (pip install --no-index --find-links; the project itself runs from this checkout);
#   2. on whatever JAX sees (GPU, TPU, or CPU with JAX_PLATFORMS=cpu) runs the
#      device-generic tests (pytest -m device_generic, tests/device_generic.py);
#   3. `multiserve doctor` (the invariance plan on this device) on a tiny random model;
#   4. `multiserve bench` on the tiny random model and on a ~1B Llama-shaped random-weight
#      model (multiserve/bench/random_model.py);
#   5. writes ONE JSON report: device kind, jax version, test counts, doctor's plan
#      summary, bench tok/s (default ./device-check.json).
# Each step's log, and the full doctor and bench outputs, are kept next to the report
# (device-check.logs/); the large model's bench entry holds its step-time breakdown.
# Exit 0 only when every step passed.
# Environment:
#   PYTHON              the image's python (default python3)
#   DEVICE_WHEELS       the folder of device-wheels.sh (default ./device-wheels)
#   DEVICE_CHECK_REPORT the JSON report path (default ./device-check.json)
#   DEVICE_CHECK_LARGE  1b | small | skip: the large bench model (default: 1b on an
#                       accelerator, small on CPU, where 1b would take long)
#   DEVICE_CHECK_PYTEST_ARGS  extra pytest arguments (e.g. "-k pause" for a shorter run)
#   DEVICE_CHECK_TEST_BUDGET  seconds the tests may take (default 0: no limit); past it
#                       pytest is interrupted and the report counts what ran
#   DEVICE_PIP_ARGS     extra pip install arguments (e.g. --break-system-packages, --user)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=$(realpath "${DEVICE_WHEELS:-./device-wheels}")
REPORT=$(realpath -m "${DEVICE_CHECK_REPORT:-./device-check.json}")
LOGS="${REPORT%.json}.logs"
WORK=$(mktemp -d -t device-check.XXXXXX)
mkdir -p "$LOGS"
status=0
step() { echo "device-check: $*" >&2; }

# ---- 1. install from the folder only -------------------------------------------------
[ -f "$WHEELS/requirements.txt" ] || { step "no $WHEELS/requirements.txt: run scripts/device-wheels.sh"; exit 2; }
step "installing from $WHEELS"
# shellcheck disable=SC2086
if ! "$PY" -m pip install -q --isolated --no-index --find-links "$WHEELS" ${DEVICE_PIP_ARGS:-} \
    -r "$WHEELS/requirements.txt" > "$LOGS/install.log" 2>&1; then
  step "install failed (see $LOGS/install.log)"; tail -5 "$LOGS/install.log" >&2; exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -f "$WHEELS/tokenizer/tokenizer.json" ]; then
  export MULTISERVE_TOKENIZER_DIR="$WHEELS/tokenizer"
fi
# what JAX sees unless told (tests/conftest.py would otherwise default to cpu)
if [ -z "${JAX_PLATFORMS:-}" ]; then
  JAX_PLATFORMS=$("$PY" -c "import jax; print(jax.devices()[0].platform)" 2>"$LOGS/jax.log") \
    || { step "jax does not start (see $LOGS/jax.log)"; exit 2; }
  # "gpu" names CUDA and ROCm both: a JAX that has one plugin fails to start the other
  # when told "gpu" (jax 0.11), so the backend that starts is named
  if [ "$JAX_PLATFORMS" = gpu ]; then
    for backend in cuda rocm; do
      if JAX_PLATFORMS=$backend "$PY" -c "import jax; jax.devices()" 2>>"$LOGS/jax.log"; then
        JAX_PLATFORMS=$backend; break
      fi
    done
  fi
fi
export JAX_PLATFORMS
PLATFORM=${JAX_PLATFORMS%%,*}
LARGE=${DEVICE_CHECK_LARGE:-$([ "$PLATFORM" = cpu ] && echo small || echo 1b)}
step "platform $PLATFORM; large bench model: $LARGE"

# ---- 2. the device-generic tests -------------------------------------------------------
# only the files that hold device-generic tests are collected: the others import what the
# image need not have (torch, openai, ...)
mapfile -t files < <("$PY" -c "import sys; sys.path.insert(0, 'tests')
from device_generic import DEVICE_GENERIC_FILES
print('\n'.join('tests/' + f for f in sorted(DEVICE_GENERIC_FILES)))")
step "pytest -m device_generic (${#files[@]} files)"
# shellcheck disable=SC2086
# a budget ends the run with SIGINT: pytest still writes its counts of what ran
timeout -s INT -k 30 "${DEVICE_CHECK_TEST_BUDGET:-0}" \
  "$PY" -m pytest -q -p no:cacheprovider -m device_generic --junitxml="$WORK/junit.xml" \
  ${DEVICE_CHECK_PYTEST_ARGS:-} "${files[@]}" > "$LOGS/pytest.log" 2>&1
rc=$?
[ "$rc" = 0 ] || status=1
[ "$rc" = 124 ] && { step "the test budget ended the run"; touch "$WORK/tests_cut_short"; }
tail -3 "$LOGS/pytest.log" >&2

# ---- 3./4. random models, doctor, bench ------------------------------------------------
models=(tiny)
[ "$LARGE" != skip ] && models+=("$LARGE")
for size in "${models[@]}"; do
  dtype=float32
  [ "$size" = 1b ] && dtype=bfloat16
  "$PY" -m multiserve.bench.random_model "$WORK/$size" --size "$size" --dtype "$dtype" \
    > "$LOGS/model-$size.log" 2>&1 || { step "random model $size failed"; status=1; }
done
step "doctor (tiny model)"
"$PY" -m multiserve.cli doctor --json --model "$WORK/tiny" > "$WORK/doctor.json" \
  2> "$LOGS/doctor.log" || status=1
for size in "${models[@]}"; do
  step "bench ($size model)"
  # the large model's run also measures its step-time breakdown (products, attention,
  # sampler, host; bench/breakdown.py; a failure there is reported, not fatal)
  if [ "$size" = tiny ]; then
    flags=(--num-prompts 16 --output-len 32 --token-paddings 64 256 --bs-paddings 16
           --max-total-tokens 8192 --no-breakdown)
  else
    flags=(--num-prompts 16 --output-len 32 --token-paddings 256 --bs-paddings 16
           --max-total-tokens 16384)
  fi
  "$PY" -m multiserve.cli bench --model "$WORK/$size" "${flags[@]}" \
    --no-progress > "$WORK/bench-$size.out" 2> "$LOGS/bench-$size.log" || status=1
done
# the full outputs travel with the logs (the report keeps a summary)
cp "$WORK"/bench-*.out "$WORK/doctor.json" "$LOGS/" 2>/dev/null

# ---- 5. one JSON report ------------------------------------------------------------------
"$PY" - "$WORK" "$REPORT" "$status" "${models[@]}" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
import jax
import jaxlib
work, report, status, sizes = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]

def last_json(path):
    """The file's JSON document (doctor --json), or its last one-line JSON (bench)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None

tests = None
try:
    suite = ET.parse(work / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    tests = {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
             "failed": n["failures"], "errors": n["errors"], "skipped": n["skipped"],
             "seconds": float(suite.get("time", 0)), "failed_tests": failed,
             "cut_short_by_budget": (work / "tests_cut_short").exists()}
except (OSError, ET.ParseError, AttributeError):
    pass
doctor = last_json(work / "doctor.json")
if doctor is not None:  # the plan in short: which kernel each primitive got
    plan = doctor.get("plan", {})
    doctor = {k: doctor.get(k) for k in ("verified", "problems", "program_sharing_hook",
                                         "cached", "probe_seconds", "key_hash")}
    doctor["product_kernels"] = sorted({r[1] for p in plan.get("products", [])
                                        for r in p.get("by_rows", [])})
    doctor["attention_kernel"] = plan.get("attention", {}).get("kernel")
bench = {}
for size in sizes:
    b = last_json(work / f"bench-{size}.out")
    bench[size] = None if b is None else {
        k: b.get(k) for k in ("model", "device", "dtype", "num_prompts", "output_len",
                              "tokens_per_s", "startup_s", "compile_s", "cache_miss_count")}
    if b is not None:
        bench[size]["itl_p50_s"] = b.get("ours", {}).get("itl_p50_s")
        if b.get("breakdown"):  # ms per part of a decode step, or why it failed
            bd = b["breakdown"]
            bench[size]["breakdown_ms"] = bd.get("ms", bd.get("error"))
d = jax.devices()[0]
out = {"ok": status == 0 and tests is not None and tests["failed"] + tests["errors"] == 0
             and doctor is not None and all(bench.values()),
       "platform": d.platform, "device_kind": d.device_kind, "device_count": jax.device_count(),
       "jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": sys.version.split()[0],
       "tests": tests, "doctor": doctor,
       "bench": bench}
report.write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out, indent=1))
sys.exit(0 if out["ok"] else 1)
EOF
rc=$?
step "report: $REPORT (logs: $LOGS)"
rm -rf "$WORK"
exit $rc
