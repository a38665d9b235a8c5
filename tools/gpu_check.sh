#!/usr/bin/env bash
# Every GPU check of ckptd in one run (5.2 minutes on one H200, 6-7 on an H100), ending with one table:
#   the CUDA tests (tests/integration/test_cuda_staging.py, test_daemon_no_gpu.py) and
#   `ckptd bench train --device cuda` (the GPT-like loop: ckptd defaults and lazy+attach against
#   no checkpointing and DCP's best working configuration; stalls, fence wait, the device-to-host
#   floor after a synchronisation and in the loop (mode d2h), ring pinning time, daemon memory,
#   bit-exact checks, the issue's targets).
#
#   tools/gpu_check.sh [WHEELS_DIR]
#
# Run from the repository root with the python that has torch (PYTHON, default python3). ckptd
# runs from the checkout (PYTHONPATH), nothing is installed into the system. A GPU machine may
# lack ckptd's other dependencies (pyzmq, crc32c, msgspec; megatron-core for one test): WHEELS_DIR holds
# their wheels for that python, installed with --no-index into a private directory; made on a
# machine with network, e.g. for Python 3.12 on x86-64:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d WHEELS_DIR pyzmq crc32c msgspec megatron-core==0.16.1
# Without a needed one it stops with the list of what is missing. Outputs (the JSON of the
# benchmark, the test log) go to $OUT when set, else to a temporary directory.
# Knobs: GPU_CHECK_TRAIN_ARGS (default "--every 25,3 --saves 3 --dir /dev/shm --modes none,d2h,dcp_best,
# ckptd,ckptd_lazy,ckptd_lazy_prepared": checkpoints on a tmpfs, as the issue measured; 3 saves so
# that one comes after the ring's pinning), GPU_CHECK_TESTS (the pytest node ids to run; default
# both files), GPU_CHECK_TEST_TIMEOUT_S (180), GPU_CHECK_TRAIN_TIMEOUT_S (360); GPU_CHECK_QUICK=1
# (about 3.5 minutes, for a short device lease: no spawned multi-rank tests, a save every 25 steps
# only; an H200 ran about that, with 2 saves, in 199 s). Measured: the tests
# some 130 s on an H100 (the multi-rank ones are spawned interpreters, see tools/harness/ranks.py);
# the benchmark 243 s there with 2 saves and 4 modes; on an H200 the 19 tests 95 s and the
# benchmark 200 s with both intervals, 3 saves and 5 modes (d2h adds some 15 s; its progress lines
# say where a run stopped by the timeout got to).
set -uo pipefail

PY="${PYTHON:-python3}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WHEELS="${1:-}"
OUTDIR="${OUT:-$(mktemp -d /tmp/ckptd-gpu-check.XXXXXX)}"
SITE="$(mktemp -d /tmp/ckptd-site.XXXXXX)"
MODES="none,d2h,dcp_best,ckptd,ckptd_lazy,ckptd_lazy_prepared"
TESTS="tests/integration/test_cuda_staging.py tests/integration/test_daemon_no_gpu.py"
if [ "${GPU_CHECK_QUICK:-0}" = 1 ]; then  # about 3.5 minutes: a short device lease
    DEFAULT_TRAIN="--every 25 --saves 3 --dir /dev/shm --modes $MODES"
    for t in test_two_ranks_sharing_one_gpu test_dtensor_state_dict_on_a_cuda_mesh \
        test_megatron_gpt_trained_on_cuda_saves_and_loads_bit_exact; do  # the spawned multi-rank ones
        TESTS="$TESTS --deselect=tests/integration/test_cuda_staging.py::$t"
    done
else
    DEFAULT_TRAIN="--every 25,3 --saves 3 --dir /dev/shm --modes $MODES"
fi
TRAIN_ARGS="${GPU_CHECK_TRAIN_ARGS:-$DEFAULT_TRAIN}"
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

say() { echo "[gpu_check $(date +%H:%M:%S)] $*" >&2; }

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: $PY has no torch that sees a CUDA device; run this on a GPU machine" >&2
    exit 2
fi

missing() {  # the modules ckptd, its tests and the benchmark need that this python cannot import
    "$PY" - <<'EOF'
import importlib.util
need = ["zmq", "msgpack", "msgspec", "psutil", "tqdm", "crc32c", "prometheus_client", "numpy", "pytest", "pytest_timeout"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
EOF
}

MISSING="$(missing)"
if [ -n "$MISSING" ] && [ -n "$WHEELS" ]; then
    say "installing the wheels of $WHEELS into $SITE (for: $MISSING)"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl; then
        echo "gpu_check: pip could not install the wheels in $WHEELS (wrong Python version or platform?)" >&2
        exit 2
    fi
    export PYTHONPATH="$PYTHONPATH:$SITE"
    MISSING="$(missing)"
elif [ -n "$WHEELS" ]; then  # nothing missing; megatron-core may still come from there
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
        && export PYTHONPATH="$PYTHONPATH:$SITE"
fi
if [ -n "$MISSING" ]; then
    echo "gpu_check: $PY cannot import: $MISSING. Pass a directory of their wheels for this python" \
         "(python package names: pyzmq for zmq, crc32c, msgspec, prometheus-client, pytest-timeout...; see the" \
         "header of tools/gpu_check.sh for the pip download command)" >&2
    exit 2
fi

say "CUDA tests"
# The project's addopts name pytest-xdist options of a newer release than a GPU image may hold.
# shellcheck disable=SC2086  # GPU_CHECK_TESTS is a list of node ids
timeout "${GPU_CHECK_TEST_TIMEOUT_S:-180}" "$PY" -m pytest -o addopts="" -q -p no:cacheprovider -rfEs \
    --junitxml "$OUTDIR/gpu_tests.xml" \
    ${GPU_CHECK_TESTS:-$TESTS} \
    >"$OUTDIR/gpu_tests.log" 2>&1
TESTS_RC=$?
tail -n 25 "$OUTDIR/gpu_tests.log" >&2

say "ckptd bench train --device cuda $TRAIN_ARGS"
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of options
timeout "${GPU_CHECK_TRAIN_TIMEOUT_S:-360}" "$PY" -m ckptd.cli bench train --device cuda $TRAIN_ARGS \
    --out "$OUTDIR/train.json" >"$OUTDIR/train.txt" 2>"$OUTDIR/train.err"
TRAIN_RC=$?
tail -n 40 "$OUTDIR/train.err" >&2

"$PY" - "$OUTDIR" "$TESTS_RC" "$TRAIN_RC" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, tests_rc, train_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
import torch

print(f"== ckptd GPU check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, python {sys.version.split()[0]}")
rows = []
try:
    suite = ET.parse(out / "gpu_tests.xml").getroot().iter("testcase")
    for case in suite:
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "FAILED"
            elif child.tag == "skipped":
                outcome = "skipped: " + (child.get("message") or "")[:60]
        rows.append((case.get("name"), outcome, f"{float(case.get('time', 0)):.1f} s"))
except (OSError, ET.ParseError) as exc:
    rows.append(("(tests)", f"no results ({exc}); exit {tests_rc}", ""))
print(f"{'test':<78}{'outcome':<30}{'time':>8}")
for name, outcome, t in rows:
    print(f"{name[:77]:<78}{outcome:<30}{t:>8}")
if tests_rc == 124:
    print("tests: TIMED OUT (GPU_CHECK_TEST_TIMEOUT_S)")
print()
try:
    print((out / "train.txt").read_text().rstrip())
except OSError:
    pass
if train_rc:
    print(f"bench train: exit {train_rc}{' (timed out: GPU_CHECK_TRAIN_TIMEOUT_S)' if train_rc == 124 else ''}; see {out}/train.err")
EOF
[ "$TESTS_RC" -eq 0 ] && [ "$TRAIN_RC" -eq 0 ]
