"""The activation gate: admission by version, exclusive activations, drains, refusals."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bulletin.errors import InvalidInput
from bulletin.sidecar.gate import ActivationGate, Lease, Refusal
from bulletin.sidecar.requirements import VersionRequirement


def test_nothing_active_is_not_ready_after_the_budget() -> None:
    async def scenario() -> None:
        gate = ActivationGate()
        out = await gate.enter(VersionRequirement(), 0.02)
        assert isinstance(out, Refusal) and out.reason == "not_ready"
        assert out.waited >= 0.02
        assert gate.waiting == 0

    asyncio.run(scenario())


def test_admitted_at_the_active_version_and_released() -> None:
    async def scenario() -> None:
        gate = ActivationGate()
        gate.set_active(3)
        lease = await gate.enter(VersionRequirement(minimum=2), 1.0)
        assert isinstance(lease, Lease) and lease.version == 3
        assert gate.in_flight == 1
        gate.leave(lease)
        gate.leave(lease)  # idempotent
        assert gate.in_flight == 0

    asyncio.run(scenario())


def test_waits_for_a_newer_version_and_asks_for_it() -> None:
    async def scenario() -> None:
        demanded: list[VersionRequirement] = []
        gate = ActivationGate(on_demand=demanded.append)
        gate.set_active(3)
        waiter = asyncio.ensure_future(gate.enter(VersionRequirement(minimum=5), 5.0))
        await asyncio.sleep(0.01)
        assert demanded == [VersionRequirement(minimum=5)]
        gate.set_active(4)
        await asyncio.sleep(0.01)
        assert not waiter.done()
        gate.set_active(6)
        lease = await waiter
        assert isinstance(lease, Lease) and lease.version == 6

    asyncio.run(scenario())


def test_exact_versions_in_the_past_are_gone() -> None:
    async def scenario() -> None:
        gate = ActivationGate()
        gate.set_active(3)
        out = await gate.enter(VersionRequirement(exact=2), 5.0)
        assert isinstance(out, Refusal) and out.reason == "gone" and out.current == 3
        waiter = asyncio.ensure_future(gate.enter(VersionRequirement(exact=4), 5.0))
        await asyncio.sleep(0.01)
        gate.set_active(5)  # skipped past 4
        out = await waiter
        assert isinstance(out, Refusal) and out.reason == "gone"

    asyncio.run(scenario())


def test_behind_when_the_budget_runs_out() -> None:
    async def scenario() -> None:
        gate = ActivationGate()
        gate.set_active(1)
        out = await gate.enter(VersionRequirement(minimum=2), 0.02)
        assert isinstance(out, Refusal) and out.reason == "behind" and out.current == 1
        assert "at least version 2" in out.message
        assert gate.waiting == 0

    asyncio.run(scenario())


def test_activation_waits_for_leases_and_holds_new_requests() -> None:
    async def scenario() -> None:
        gate = ActivationGate()
        gate.set_active(1)
        old = await gate.enter(VersionRequirement(), 1.0)
        assert isinstance(old, Lease)
        writer = asyncio.ensure_future(gate.acquire_exclusive(None))
        await asyncio.sleep(0.01)
        assert not writer.done() and gate.activating
        newcomer = asyncio.ensure_future(gate.enter(VersionRequirement(), 5.0))
        await asyncio.sleep(0.01)
        assert not newcomer.done()  # admission stops as soon as an activation is pending
        gate.leave(old)
        drained, preempted = await writer
        assert preempted == 0 and drained >= 0.01
        assert not newcomer.done()
        gate.release_exclusive(2)
        lease = await newcomer
        assert isinstance(lease, Lease) and lease.version == 2
        assert gate.activations == 2  # 1, then 2
        assert not old.preempted

    asyncio.run(scenario())


def test_drain_timeout_preempts_and_marks_the_lease() -> None:
    async def scenario() -> None:
        gate = ActivationGate()
        gate.set_active(1)
        stream = await gate.enter(VersionRequirement(), 1.0)
        assert isinstance(stream, Lease)
        _, preempted = await gate.acquire_exclusive(0.02)
        assert preempted == 1 and stream.preempted
        gate.release_exclusive(2)
        assert stream.activation != gate.activations

    asyncio.run(scenario())


def test_busy_when_an_activation_outlasts_the_budget() -> None:
    async def scenario() -> None:
        gate = ActivationGate()
        gate.set_active(1)
        await gate.acquire_exclusive(None)
        out = await gate.enter(VersionRequirement(minimum=1), 0.02)
        assert isinstance(out, Refusal) and out.reason == "busy"
        gate.release_exclusive(None)
        lease = await gate.enter(VersionRequirement(minimum=1), 0.02)
        assert isinstance(lease, Lease) and lease.version == 1

    asyncio.run(scenario())


def test_a_failed_activation_keeps_the_version() -> None:
    async def scenario() -> None:
        gate = ActivationGate()
        gate.set_active(7)
        await gate.acquire_exclusive(None)
        waiter = asyncio.ensure_future(gate.enter(VersionRequirement(), 5.0))
        await asyncio.sleep(0.01)
        gate.release_exclusive(None)
        lease = await waiter
        assert isinstance(lease, Lease) and lease.version == 7
        assert gate.activations == 1

    asyncio.run(scenario())


def test_exclusive_misuse_is_refused() -> None:
    async def scenario() -> None:
        gate = ActivationGate()
        with pytest.raises(InvalidInput):
            gate.release_exclusive(1)
        await gate.acquire_exclusive(None)
        with pytest.raises(InvalidInput):
            await gate.acquire_exclusive(None)

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_no_trace() -> None:
    async def scenario() -> None:
        gate = ActivationGate()
        gate.set_active(1)
        waiter = asyncio.ensure_future(gate.enter(VersionRequirement(minimum=3), 5.0))
        await asyncio.sleep(0.01)
        assert gate.waiting == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.waiting == 0
        gate.set_active(3)
        assert gate.in_flight == 0

    asyncio.run(scenario())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("enter"), st.sampled_from(["any", "min", "exact"]), st.integers(0, 3)),
            st.tuples(st.just("leave"), st.integers(0, 7), st.just(0)),
            st.tuples(st.just("activate"), st.integers(0, 2), st.just(0)),
        ),
        max_size=25,
    )
)
def test_random_schedules_keep_the_invariants(ops: list[tuple[str, object, int]]) -> None:
    """No lease is ever granted for a version other than the active one, none while an
    activation holds the gate, and an activation only starts once leases are gone."""

    async def scenario() -> None:
        gate = ActivationGate()
        gate.set_active(1)
        leases: list[Lease] = []
        pending: list[asyncio.Future[Lease | Refusal]] = []
        version = 1

        def collect() -> None:
            for fut in [f for f in pending if f.done()]:
                pending.remove(fut)
                out = fut.result()
                if isinstance(out, Lease):
                    assert not gate.activating
                    assert out.version == gate.active_version
                    leases.append(out)

        for op, arg, extra in ops:
            if op == "enter":
                kind = arg
                req = (
                    VersionRequirement()
                    if kind == "any"
                    else VersionRequirement(minimum=version + extra)
                    if kind == "min"
                    else VersionRequirement(exact=max(0, version + extra - 1))
                )
                pending.append(asyncio.ensure_future(gate.enter(req, 0.05)))
            elif op == "leave" and leases:
                gate.leave(leases.pop(int(str(arg)) % len(leases)))
            elif op == "activate":
                for lease in leases:
                    gate.leave(lease)
                leases.clear()
                _, preempted = await gate.acquire_exclusive(1.0)
                assert preempted == 0 and gate.in_flight == 0
                version += int(str(arg))
                gate.release_exclusive(version)
            for _ in range(4):  # a granted waiter needs a few loop turns to resume
                await asyncio.sleep(0)
            collect()
        for fut in pending:
            await fut
        collect()
        for lease in leases:
            gate.leave(lease)
        assert gate.in_flight == 0 and gate.waiting == 0

    asyncio.run(scenario())
