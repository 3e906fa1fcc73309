#!/usr/bin/env bash
# Start LocalStack (S3 only) as a host process on 127.0.0.1 and wait until S3 is up.
#
# Prints the endpoint URL (and nothing else) on stdout; progress goes to stderr.
# If the instance recorded in the run directory is already running and healthy,
# prints its endpoint and leaves it alone.
#
# Environment:
#   LOCALSTACK_PORT     port to listen on; default 4566 when free, else one the OS picks
#   LOCALSTACK_RUN_DIR  where the pid file, log, data and cache live
#                       (default: <repo>/.localstack); give each concurrent instance its own
#   LOCALSTACK_START_TIMEOUT  seconds to wait for S3 to report "running" (default 120)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
venv="$repo/.localstack/venv"
run_dir="${LOCALSTACK_RUN_DIR:-$repo/.localstack}"
timeout="${LOCALSTACK_START_TIMEOUT:-120}"
pid_file="$run_dir/localstack.pid"
endpoint_file="$run_dir/localstack.endpoint"
log="$run_dir/localstack.log"
py="$venv/bin/python"

if [[ ! -x "$py" ]]; then
    echo "localstack/start.sh: not installed; run localstack/install.sh first" >&2
    exit 1
fi
mkdir -p "$run_dir"
run_dir="$(cd "$run_dir" && pwd)"

# Answers 0 when S3 reports "running" at the endpoint given as $1.
healthy() {
    "$py" - "$1" <<'EOF'
import json, sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1] + "/_localstack/health", timeout=2) as r:
        services = json.load(r).get("services", {})
except Exception:
    sys.exit(1)
sys.exit(0 if services.get("s3") == "running" else 1)
EOF
}

# Answers 0 when pid $1 is alive and is a LocalStack runtime (not a recycled pid).
is_ours() {
    [[ -r "/proc/$1/cmdline" ]] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -q 'localstack.runtime.main'
}

if [[ -f "$pid_file" && -f "$endpoint_file" ]]; then
    pid="$(cat "$pid_file")"
    endpoint="$(cat "$endpoint_file")"
    if is_ours "$pid" && healthy "$endpoint"; then
        echo "localstack: already running (pid $pid)" >&2
        echo "$endpoint"
        exit 0
    fi
    rm -f "$pid_file" "$endpoint_file"
fi

port_free() {
    "$py" - "$1" <<'EOF'
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
finally:
    s.close()
EOF
}

if [[ -n "${LOCALSTACK_PORT:-}" ]]; then
    port="$LOCALSTACK_PORT"
    if ! port_free "$port"; then
        echo "localstack/start.sh: port $port on 127.0.0.1 is taken" >&2
        exit 1
    fi
elif port_free 4566; then
    port=4566
else
    # Another instance holds the default port (another checkout, another test run).
    port="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
fi
endpoint="http://127.0.0.1:$port"

mkdir -p "$run_dir/data" "$run_dir/cache" "$run_dir/tmp"
: >"$log"
# The environment from the team's measured notes: S3 only, no DNS server, and
# OVERRIDE_IN_DOCKER=0 so that it never believes it runs in a container (it
# would then rewrite system files). TMPDIR keeps its scratch files in the run
# directory; setsid makes it a process group leader so stop.sh can end the group.
env -i \
    PATH="$venv/bin:/usr/local/bin:/usr/bin:/bin" \
    HOME="${HOME:-$run_dir}" \
    LANG=C.UTF-8 \
    TMPDIR="$run_dir/tmp" \
    SERVICES=s3 \
    GATEWAY_LISTEN="127.0.0.1:$port" \
    EAGER_SERVICE_LOADING=1 \
    DISABLE_EVENTS=1 \
    SKIP_SSL_CERT_DOWNLOAD=1 \
    DNS_ADDRESS=0 \
    OVERRIDE_IN_DOCKER=0 \
    FILESYSTEM_ROOT="$run_dir/data" \
    XDG_CACHE_HOME="$run_dir/cache" \
    setsid "$py" -m localstack.runtime.main </dev/null >>"$log" 2>&1 &
pid=$!
echo "$pid" >"$pid_file"

deadline=$((SECONDS + timeout))
until healthy "$endpoint"; do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "localstack/start.sh: LocalStack exited during start; last lines of $log:" >&2
        tail -n 40 "$log" >&2
        rm -f "$pid_file"
        exit 1
    fi
    if ((SECONDS >= deadline)); then
        echo "localstack/start.sh: S3 not running after ${timeout}s; last lines of $log:" >&2
        tail -n 40 "$log" >&2
        LOCALSTACK_RUN_DIR="$run_dir" "$here/stop.sh" >&2 || true
        exit 1
    fi
    sleep 0.5
done

echo "$endpoint" >"$endpoint_file"
echo "localstack: S3 running at $endpoint (pid $pid, log $log)" >&2
echo "$endpoint"
