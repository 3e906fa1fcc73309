"""``bulletin sync`` in a process of its own, with its peak memory measured.

Run as ``python -m tests.run.hostile_sync OUT STORE RUN DIR [VERSION]``. It imports
everything a sync needs first, caps its address space (``RLIMIT_AS``: a bug that asks
for gigabytes fails here instead of taking the machine), resets the kernel's peak-RSS
mark (``/proc/self/clear_refs``), runs the CLI's ``sync`` and writes to ``OUT`` (JSON)
the exit status and how far the peak resident set grew during the sync (``VmHWM``
minus the resident set at the reset), in bytes. The CLI prints its error on stderr.
"""

from __future__ import annotations

import json
import resource
import sys

#: Address space allowed on top of what the process holds after its imports.
HEADROOM = 3 << 30


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def main(argv: list[str]) -> int:
    out, store, run, node = argv[:4]
    import boto3  # noqa: F401  (imported now, so that its memory is not the sync's)
    import numpy  # noqa: F401

    import bulletin.storage.s3
    import bulletin.subscriber  # noqa: F401
    from bulletin.cli import main as cli

    args = ["sync", "--store", store, "--run", run, "--to", node]
    if len(argv) > 4:
        args += ["--version", argv[4]]
    limit = _status("VmSize") + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    start = _status("VmRSS")
    status = cli(args)
    grew = _status("VmHWM") - start
    with open(out, "w") as f:
        json.dump({"status": status, "peak_growth": grew}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
