#!/usr/bin/env bash
# Stop the LocalStack started by start.sh in the same run directory. Idempotent.
#
# Ends its process group (TERM, then KILL after 15 s), found through the pid file;
# a pid that no longer belongs to a LocalStack runtime is never signalled.
#
# Environment:
#   LOCALSTACK_RUN_DIR  as for start.sh (default: <repo>/.localstack)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
run_dir="${LOCALSTACK_RUN_DIR:-$repo/.localstack}"
pid_file="$run_dir/localstack.pid"

if [[ ! -f "$pid_file" ]]; then
    echo "localstack: not running" >&2
    exit 0
fi
pid="$(cat "$pid_file")"

is_ours() {
    [[ -r "/proc/$1/cmdline" ]] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -q 'localstack.runtime.main'
}

if [[ "$pid" =~ ^[0-9]+$ ]] && is_ours "$pid"; then
    # start.sh made it a session (and so process group) leader: its group id is its pid.
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 150); do
        is_ours "$pid" || break
        sleep 0.1
    done
    if is_ours "$pid"; then
        echo "localstack: still running after 15 s, killing" >&2
        kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    echo "localstack: stopped (pid $pid)" >&2
else
    echo "localstack: not running (stale pid file)" >&2
fi
rm -f "$pid_file" "$run_dir/localstack.endpoint"
