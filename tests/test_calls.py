"""The request/reply matcher (daemon/wire/calls.py), without any connection."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from monarch_fs.daemon.wire.calls import Call, Calls


async def test_settle_out_of_order() -> None:
    calls: Calls[Call[str]] = Calls()
    got: list[tuple[int, str]] = []

    async def ask() -> None:
        with calls.expecting(Call()) as call:
            got.append((call.id, await call.result()))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()
        assert len(calls) == 3
        for cid in (3, 1, 2):
            assert calls.settle(cid, f"answer {cid}")
    assert sorted(got) == [(1, "answer 1"), (2, "answer 2"), (3, "answer 3")]
    assert len(calls) == 0


async def test_an_error_is_raised_in_its_caller_only() -> None:
    calls: Calls[Call[str]] = Calls()
    bad = calls.add(Call())
    good = calls.add(Call())
    assert calls.fail(bad.id, ValueError("no such op"))
    assert calls.settle(good.id, "fine")
    with pytest.raises(ValueError, match="no such op"):
        await bad.result()
    assert await good.result() == "fine"


async def test_unknown_and_repeated_ids_are_ignored() -> None:
    calls: Calls[Call[int]] = Calls()
    call = calls.add(Call())
    assert not calls.settle(99, 1)  # nobody waits for it (an abandoned request's reply)
    assert not calls.settle("1", 1)  # ids from the wire may be anything
    assert not calls.settle(None, 1)
    assert calls.settle(call.id, 7)
    assert not calls.settle(call.id, 8)  # the first outcome wins
    assert not calls.fail(call.id, RuntimeError("late"))
    assert await call.result() == 7
    calls.remove(call)
    assert not calls.settle(call.id, 9) and len(calls) == 0
    calls.remove(call)  # twice is fine


async def test_fail_all_fails_each_pending_call_with_its_own_error() -> None:
    calls: Calls[Call[str]] = Calls()
    answered = calls.add(Call())
    pending = [calls.add(Call()) for _ in range(2)]
    calls.settle(answered.id, "done before the loss")
    calls.fail_all(lambda call: ConnectionError(f"lost, call {call.id}"))
    assert await answered.result() == "done before the loss"
    errors = []
    for call in pending:
        with pytest.raises(ConnectionError) as info:
            await call.result()
        errors.append(info.value)
    assert [str(e) for e in errors] == ["lost, call 2", "lost, call 3"]
    assert errors[0] is not errors[1]


async def test_a_cancelled_waiter_removes_its_call() -> None:
    calls: Calls[Call[str]] = Calls()
    with trio.move_on_after(1) as scope:  # cancelled below, long before the deadline
        with calls.expecting(Call()) as call:
            assert call in calls
            scope.cancel()
            await call.result()
    assert scope.cancelled_caught
    assert call not in calls and len(calls) == 0
    assert not calls.settle(call.id, "too late")  # the late reply finds no one


async def test_a_waiter_that_gives_up_before_waiting_removes_its_call() -> None:
    calls: Calls[Call[str]] = Calls()
    with pytest.raises(OSError):
        with calls.expecting(Call()):
            raise OSError("the send failed")
    assert len(calls) == 0
