"""Writers that race on one store from separate processes (spawned, so importable here).

Each opens the store again from its URL, as an independent client would, and reports
what it saw through a queue; the test process judges the results.
"""

from __future__ import annotations

from typing import Any

from bulletin.storage import Updated, open_store


def create_only_writer(url: str, writer: int, rounds: int, barrier: Any, results: Any, key_prefix: str) -> None:
    """In each round, wait for all writers, then try to create ``<key_prefix><round>``."""
    store = open_store(url)
    try:
        for round_no in range(rounds):
            barrier.wait()
            outcome = store.put_if_absent(f"{key_prefix}{round_no}", payload(writer, round_no))
            won = isinstance(outcome, Updated)
            etag = outcome.etag if isinstance(outcome, Updated) else outcome.current_etag
            results.put((round_no, writer, won, etag))
    finally:
        store.close()


def cas_writer(url: str, key: str, increments: int, barrier: Any, results: Any) -> None:
    """Read the counter at ``key`` and compare-and-swap it to +1 until ``increments`` succeed."""
    store = open_store(url)
    try:
        barrier.wait()
        done = 0
        while done < increments:
            current = store.get(key)
            value = int(current.data) + 1
            if isinstance(store.put_if_match(key, str(value).encode(), current.etag), Updated):
                results.put(value)
                done += 1
    finally:
        store.close()


def payload(writer: int, round_no: int) -> bytes:
    """What ``writer`` tries to store in ``round_no``: distinct for every pair."""
    return f"writer {writer} round {round_no}".encode()
