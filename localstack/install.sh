#!/usr/bin/env bash
# Install LocalStack (the S3 server of the integration tests) into its own virtual
# environment at <repo>/.localstack/venv.
#
# Its own environment because localstack-core pins boto3/botocore exactly, which
# would fight the project's. Idempotent and fast when nothing changed: a stamp
# file records the hash of requirements.txt and the interpreter's version, and a
# lock makes concurrent runs wait for one another instead of racing.
#
# Environment:
#   LOCALSTACK_PYTHON  interpreter to build the venv with (default: python3.11)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
state="$repo/.localstack"
venv="$state/venv"
requirements="$here/requirements.txt"
python="${LOCALSTACK_PYTHON:-python3.11}"

if ! command -v "$python" >/dev/null 2>&1; then
    echo "localstack/install.sh: $python not found (set LOCALSTACK_PYTHON)" >&2
    exit 1
fi

mkdir -p "$state"
exec 9>"$state/install.lock"
flock 9

want="$(sha256sum "$requirements" | cut -d' ' -f1) $("$python" -c 'import sys; print(sys.version.split()[0])')"
stamp="$venv/.bulletin-installed"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "localstack: up to date in $venv"
    exit 0
fi

echo "localstack: installing into $venv"
rm -rf "$venv"
"$python" -m venv "$venv"
# pip on these machines lists every local index folder it skips: keep the log readable.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
# Import the entry point now, so that a broken install fails here and not at start.
"$venv/bin/python" -c 'import localstack.runtime.main' >/dev/null
echo "$want" >"$stamp"
echo "localstack: installed"
