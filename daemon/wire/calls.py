"""Calls awaiting their outcome, matched to replies by id: the one request/reply matcher.

Every link that lets several requests be in flight (a daemon connection, a proc's connection to
its owner, the owner's calls to the ranks of a mesh) sends each request with an id and gets the
answers back in any order, from one reader task. `Calls` holds what is in flight: it gives a
call its id, the reader settles the call with that id (a value or an error; an id that nobody
waits for any more is ignored, since its waiter gave up), and when the link is lost every
pending call fails at once. A waiter that is cancelled, or that gives up before it waits (its
send failed), takes its call out again, so nothing leaks and a late answer finds no one.

    with calls.expecting(Call()) as call:
        await send(Request(op, args, call.id))
        return await call.result()

A call is settled once: the first outcome wins, later ones are ignored. That is what makes
"fail every pending call" safe to race with the answers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar, cast

import trio

T = TypeVar("T")


class Call(Generic[T]):
    """One request in flight: its id (given by `Calls.add`) and, once settled, its outcome."""

    def __init__(self) -> None:
        self.id = 0
        self._done = trio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    @property
    def settled(self) -> bool:
        return self._done.is_set()

    def set_value(self, value: T) -> bool:
        """Settle with a value; False if it was settled already."""
        return self._settle(value, None)

    def set_error(self, error: BaseException) -> bool:
        """Settle with an error, which result() raises; False if it was settled already."""
        return self._settle(None, error)

    def _settle(self, value: T | None, error: BaseException | None) -> bool:
        if self._done.is_set():
            return False
        self._value, self._error = value, error
        self._done.set()
        return True

    async def result(self) -> T:
        """Wait until settled; the value, or raise the error."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return cast(T, self._value)  # set_value ran, so it holds a T


C = TypeVar("C", bound=Call[Any])


class Calls(Generic[C]):
    """The calls in flight on one link, by id. `C` is the kind of call (a `Call`, or a subclass
    that gathers a richer outcome, such as a mesh call answered by many ranks)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._pending: dict[int, C] = {}

    def add(self, call: C) -> C:
        """Give `call` a fresh id and hold it until it is removed."""
        call.id = next(self._ids)
        self._pending[call.id] = call
        return call

    def remove(self, call: C) -> None:
        """Stop holding `call` (settled, abandoned or cancelled); removing twice is fine."""
        if self._pending.get(call.id) is call:
            del self._pending[call.id]

    def pending(self) -> list[C]:
        """The calls held now, oldest first."""
        return list(self._pending.values())

    @contextmanager
    def expecting(self, call: C) -> Iterator[C]:
        """Hold `call` for the length of the block, however the block ends (an error, a
        cancelled wait): the usual way to make a request."""
        self.add(call)
        try:
            yield call
        finally:
            self.remove(call)

    def get(self, cid: object) -> C | None:
        """The call waiting under `cid`, if any (ids from the wire may be anything)."""
        return self._pending.get(cid) if isinstance(cid, int) else None

    def settle(self, cid: object, value: Any) -> bool:
        """Settle call `cid` with `value`; False if no one waits for that id."""
        call = self.get(cid)
        return call is not None and call.set_value(value)

    def fail(self, cid: object, error: BaseException) -> bool:
        """Settle call `cid` with `error`; False if no one waits for that id."""
        call = self.get(cid)
        return call is not None and call.set_error(error)

    def fail_all(self, error: Callable[[C], BaseException]) -> None:
        """The link is lost (or the calls' target failed): every pending call fails, each with
        its own exception from `error(call)` (one exception object raised in many tasks would
        gather all their tracebacks). Calls already settled keep their outcome."""
        for call in list(self._pending.values()):
            call.set_error(error(call))

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, call: object) -> bool:
        return isinstance(call, Call) and self._pending.get(call.id) is call
