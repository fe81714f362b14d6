#!/usr/bin/env bash
# The trainer's update step on a CUDA GPU: one script, PASS or FAIL.
#
# It runs tests/gpu/test_update_cuda.py with STARGYM_REQUIRE_CUDA=1 (no GPU is a failure, not a
# skip): PolicyUpdater.update of one batch sampled on the CPU gives, on the GPU in float32, the
# CPU's metrics, gradients (1e-4 of their norm: no TF32) and weights; with bf16 autocast (the
# default `bf16: auto` on a GPU) a finite update that moves the weights, within bfloat16 rounding
# of the float32 one. Then it measures the update: `bench/trainer.py --device cuda --rounds 3`
# (PolicyUpdater.update against a bare loop on the frozenlake-tiny batch, timers read after
# torch.cuda.synchronize()), into bench/results/trainer-cuda.json, and the same batch through a
# random-weight model of Qwen2.5-0.5B's architecture (`--shape qwen2.5-0.5b`), into
# bench/results/trainer-qwen2.5-0.5b-cuda.json.
#
# Needs: an NVIDIA GPU with its driver, python3 (3.11 or newer) with torch (a CUDA build),
# transformers, tokenizers, safetensors, numpy, pyyaml, typer, httpx and pytest; no network and
# no `pip install -e .`: the repository root goes on PYTHONPATH (so the tests and the benchmark
# name the FrozenLake env by class path, not by its entry point). The other imports of that code
# come from wheels in `.whl/` when that folder exists: they are installed with `pip install
# --target /tmp/site` (or unzipped, without pip) and put first on PYTHONPATH. For a Python 3.12
# machine that lacks them, download on one with network (versions: pyproject.toml, .venv):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#     pydantic-settings==2.16.3 python-dotenv==1.2.4 orjson==3.13.0 redis==8.1.0 gymnasium==1.4.0 \
#     farama-notifications==0.0.6 shellingham==1.5.4 typing-extensions==4.16.0 iniconfig==2.3.1
# (redis, pydantic-settings, python-dotenv: for tests/conftest.py. The last three in case the
# machine's are missing or older: typer imports shellingham, pydantic 2.14 wants
# typing-extensions >= 4.16, pytest imports iniconfig.)
# Usage, from anywhere in the repository:
#   deploy/gpu/check_trainer.sh
# Settings (environment):
#   PYTHON          interpreter (default python3)
#   BENCH_SHAPES    bench/trainer.py --shape values to measure (default "tiny qwen2.5-0.5b")
#   SITE_DIR        where the wheels go (default /tmp/site)
#   TEST_TIMEOUT_S  limit for the tests (default 300 s); BENCH_TIMEOUT_S for the benchmark (300 s)
#   BENCH_ROUNDS    timed rounds of the benchmark (default 3)
#   OUT             when set, bench/results/trainer-cuda.json, the pytest JUnit XML and the log
#                   are copied there
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-python3}"
SITE_DIR="${SITE_DIR:-/tmp/site}"
TEST_TIMEOUT_S="${TEST_TIMEOUT_S:-300}"
BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-300}"
BENCH_ROUNDS="${BENCH_ROUNDS:-3}"
BENCH_SHAPES="${BENCH_SHAPES:-tiny qwen2.5-0.5b}"  # bench/trainer.py --shape: each its own results file
RESULTS=()
WORK="$(mktemp -d "${TMPDIR:-/tmp}/stargym-check-trainer.XXXXXX")"
LOG="$WORK/check_trainer.log"
JUNIT="$WORK/test_update_cuda.xml"
started=$(date +%s)
failures=()

# Everything the script prints also goes to $LOG.
say() { echo "$@" | tee -a "$LOG"; }

# run NAME LIMIT_S CMD...: CMD under `timeout`, its output shown and logged; a failure is recorded.
run() {
    local name="$1" limit="$2"
    shift 2
    say "== $name"
    set +e
    timeout --signal=TERM --kill-after=30 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local status=${PIPESTATUS[0]}
    set -e
    if [ "$status" -eq 124 ]; then
        failures+=("$name (ran past $limit s)")
    elif [ "$status" -ne 0 ]; then
        failures+=("$name (exit $status)")
    fi
    return 0
}

finish() {
    local elapsed=$(($(date +%s) - started))
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT"
        for results in "${RESULTS[@]}"; do
            [ -f "$results" ] && cp "$results" "$OUT/"
        done
        [ -f "$JUNIT" ] && cp "$JUNIT" "$OUT/"
    fi
    if [ "${#failures[@]}" -eq 0 ]; then
        say "PASS: PolicyUpdater.update on $gpu: float32 equals the CPU's update, bf16 autocast is" \
            "finite and within bfloat16 rounding; throughput in ${RESULTS[*]} ($elapsed s)"
        status=0
    else
        say "FAIL: ${failures[*]} ($elapsed s)"
        status=1
    fi
    if [ -n "${OUT:-}" ]; then
        cp "$LOG" "$OUT/"
    fi
    exit "$status"
}

say "== GPU"
if gpu="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"; then
    say "$gpu"
    gpu="${gpu%%$'\n'*}"
else
    say "$gpu"
    failures+=("nvidia-smi found no GPU")
    gpu="no GPU"
fi

# Nothing here reaches the network: the tiny model is made locally, the wheels come from .whl.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then
    say "== wheels from .whl into $SITE_DIR"
    ls .whl/*.whl >/dev/null 2>&1 || failures+=(".whl has no wheels")
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        run "pip install .whl/*.whl" 300 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target "$SITE_DIR" .whl/*.whl
    else
        # No pip for this interpreter: a wheel of these packages is its site-packages tree, zipped.
        run "unzip .whl/*.whl (no pip)" 300 "$PYTHON" -c '
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
    print("unzipped", wheel)' "$SITE_DIR" .whl/*.whl
    fi
    export PYTHONPATH="$SITE_DIR:$PYTHONPATH"
fi
say "PYTHONPATH=$PYTHONPATH"

run "versions and imports" 120 "$PYTHON" -c '
import platform, torch, transformers, tokenizers, safetensors
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| transformers", transformers.__version__, "| tokenizers", tokenizers.__version__,
      "| safetensors", safetensors.__version__)
print("cuda available:", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
import pydantic, orjson, redis, gymnasium, pydantic_settings
print("pydantic", pydantic.VERSION, "| orjson", orjson.__version__, "| redis", redis.__version__,
      "| gymnasium", gymnasium.__version__)
import trainer.update, services.policy, deploy.model_init, tests.synthetic  # the code under test
'

run "tests/gpu (STARGYM_REQUIRE_CUDA=1)" "$TEST_TIMEOUT_S" env STARGYM_REQUIRE_CUDA=1 \
    "$PYTHON" -m pytest tests/gpu -q -rA -p no:cacheprovider --basetemp "$WORK/pytest" \
    --junitxml "$JUNIT"

for shape in $BENCH_SHAPES; do
    if [ "$shape" = tiny ]; then results=bench/results/trainer-cuda.json; else results="bench/results/trainer-$shape-cuda.json"; fi
    RESULTS+=("$results")
    rm -f "$results"
    run "bench/trainer.py --device cuda --shape $shape --rounds $BENCH_ROUNDS" "$BENCH_TIMEOUT_S" \
        "$PYTHON" bench/trainer.py --device cuda --shape "$shape" --rounds "$BENCH_ROUNDS"
    if [ -f "$results" ]; then
        tee -a "$LOG" <"$results"
    else
        failures+=("no $results")
    fi
done

finish
