#!/usr/bin/env bash
# THE test command: everything CI checks, runnable on a fresh clone.
#
#   scripts/test.sh                  # the whole suite
#   scripts/test.sh tests/storage    # extra arguments go to pytest
#
# 1. creates .venv with python3.11 if missing and installs the project with its test
#    extras (again only when pyproject.toml changed);
# 2. installs LocalStack in its own venv and starts a private instance of it,
#    exporting BULLETIN_TEST_S3_ENDPOINT (stopped again on exit, whatever happens);
# 3. runs the gates: ruff check, ruff format --check, mypy (strict, the packages),
#    the kernels compile check (when scripts/check_kernels.py exists), then pytest.
#
# Every gate runs even if an earlier one failed, so one run shows every problem;
# the exit status is non-zero if any failed. pytest's "no tests collected" (5)
# counts as success only when the arguments select nothing on purpose.
#
# Environment:
#   PYTHON                 interpreter for .venv (default: python3.11)
#   BULLETIN_TORCH_SPEC    torch requirement installed first (default: torch==2.13.0,
#                          the CPU build on this machine's disk; a bare "torch" would
#                          pull a multi-GB CUDA build)
#   BULLETIN_SKIP_S3=1     do not start LocalStack (S3 tests then skip)
#   BULLETIN_TEST_VLLM_PATH  vLLM source kit for tests/tp (default: built or found by
#                          scripts/vllm_source.py in ~/.cache/bulletin)
#
# The codec's compiled fast path (patcher/_speedups.c) must build here: a compile error
# fails the install and the tests, rather than quietly testing NumPy alone.
set -euo pipefail
export BULLETIN_REQUIRE_NATIVE=1

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

python="${PYTHON:-python3.11}"
venv="$repo/.venv"
py="$venv/bin/python"

step() { printf '\n==> %s\n' "$*" >&2; }
# pip on these machines lists every local index folder it skips: keep the log readable.
quiet_pip() { "$py" -m pip "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }

# -- 1. the project's environment ---------------------------------------------------
if [[ ! -x "$py" ]]; then
    step "creating $venv with $python"
    "$python" -m venv "$venv"
fi
stamp="$venv/.bulletin-installed"
# The compiled fast path is built at install time: its source is part of the stamp.
want="$(cat pyproject.toml setup.py patcher/_speedups.c "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    step "installing the project and its test dependencies"
    quiet_pip install --quiet --disable-pip-version-check "${BULLETIN_TORCH_SPEC:-torch==2.13.0}"
    quiet_pip install --quiet --disable-pip-version-check -e ".[test,torch]"
    echo "$want" >"$stamp"
fi

# -- 2. the S3 server ---------------------------------------------------------------
export AWS_EC2_METADATA_DISABLED=true  # never probe the cloud metadata address
if [[ "${BULLETIN_SKIP_S3:-0}" != 1 ]]; then
    step "LocalStack"
    "$repo/localstack/install.sh"
    # A private instance (own run directory, free port): concurrent runs of this
    # script, or a LocalStack someone keeps running, never share or stop each other's.
    run_dir="$repo/.localstack/test-$$"
    export LOCALSTACK_RUN_DIR="$run_dir"
    # Quietly: pytest's summary stays the last line of a run (CI reads it).
    cleanup() {
        "$repo/localstack/stop.sh" >/dev/null 2>&1 || true
        rm -rf "$run_dir"
    }
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    endpoint="$("$repo/localstack/start.sh")"
    export BULLETIN_TEST_S3_ENDPOINT="$endpoint"
    # LocalStack takes any credentials; these keep real ones out of the tests.
    export AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_DEFAULT_REGION=us-east-1
    unset AWS_SESSION_TOKEN AWS_PROFILE AWS_ENDPOINT_URL AWS_ENDPOINT_URL_S3
fi

# -- 2b. vLLM's own code, for the tensor-parallel tests -------------------------------
# scripts/vllm_source.py: the vllm wheel's .py files and the few pinned wheels they
# import, in a cache folder (a warm cache costs nothing). If it cannot be built, the
# tests that need it skip, or fail under CI=true (tests/tp/conftest.py).
if [[ -z "${BULLETIN_TEST_VLLM_PATH:-}" ]]; then
    step "vLLM source kit"
    if kit="$("$py" "$repo/scripts/vllm_source.py")"; then
        export BULLETIN_TEST_VLLM_PATH="$kit"
    else
        echo "vLLM source kit unavailable: the vLLM TP tests will skip (fail under CI=true)" >&2
    fi
fi

# -- 3. the gates -------------------------------------------------------------------
failed=()
gate() {
    local name="$1"
    shift
    step "$name"
    if "$@"; then
        return 0
    fi
    failed+=("$name")
}

lint_paths=(bulletin patcher kernels schemas tests scripts)
gate "ruff check" "$venv/bin/ruff" check "${lint_paths[@]}"
gate "ruff format" "$venv/bin/ruff" format --check "${lint_paths[@]}"
gate "mypy" "$venv/bin/mypy"
if [[ -f "$repo/scripts/check_kernels.py" ]]; then
    gate "kernels compile check" "$py" "$repo/scripts/check_kernels.py"
fi

step "pytest $*"
set +e
"$py" -m pytest "$@"
status=$?
set -e
case $status in
    0) ;;
    5)
        if [[ $# -eq 0 ]]; then
            echo "pytest collected no tests from the whole suite" >&2
            failed+=("pytest (no tests)")
        else
            echo "pytest: no tests selected by: $*" >&2
        fi
        ;;
    *) failed+=("pytest (exit $status)") ;;
esac

if ((${#failed[@]})); then
    printf '\nFAILED:' >&2
    printf ' [%s]' "${failed[@]}" >&2
    printf '\n' >&2
    exit 1
fi
