"""What a peer may cost a server before it has proved anything, and the accept loop that holds
every connection to it.

A daemon (and a proc mesh's listener) accepts connections from anyone who can reach its port.
Without bounds, idle connections pile up until file descriptors run out; then trio's
serve_listeners logs a traceback for every failed accept (ten a second) and a legitimate client
waits for whatever frees a descriptor. So:

- connections are counted in all and per peer address; one beyond either limit is refused at
  once, with an Error frame saying why (the one frame allowed before a handshake), and closed;
- a peer that has not authenticated `handshake_timeout` seconds after connecting is dropped
  (the handler enforces it: it alone knows when the handshake is over);
- accept() failing for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) is
  retried every ACCEPT_RETRY seconds, so a client is served within that once descriptors free
  up, and it is logged once per LOG_INTERVAL, with a count, not once per attempt;
- refusals are logged the same way: once per interval for a full server, once per peer
  address per interval for a peer at its own limit.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

import trio

from .transport import refuse

ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_RETRY = 0.05  # seconds between accepts while descriptors are exhausted
LOG_INTERVAL = 60.0  # seconds between two log lines about the same condition and peer


@dataclass(frozen=True)
class Limits:
    """Connection limits of one server (the daemon's come from its command line)."""

    max_connections: int = 512  # open connections in all
    max_per_peer: int = 64  # open connections from one address (a local cluster is one address)
    handshake_timeout: float = 5.0  # seconds from accept to authenticated

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_per_peer < 1 or self.handshake_timeout <= 0:
            raise ValueError("connection limits must be positive")


class LogOnce:
    """Log a recurring condition at most once per `interval` for each key (say, a peer address),
    saying how often it recurred meanwhile: a flood of attempts costs a line a minute."""

    def __init__(self, logger: logging.Logger, interval: float = LOG_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._seen: dict[Hashable, tuple[float, int]] = {}  # key -> (last logged, since then)

    def __call__(self, key: Hashable, level: int, msg: str, *args: object) -> bool:
        """Log `msg % args` unless `key` was logged less than `interval` ago; True if logged."""
        now = self.clock()
        last, count = self._seen.get(key, (None, 0))
        if last is not None and now - last < self.interval:
            self._seen[key] = (last, count + 1)
            return False
        if len(self._seen) > 4096:  # many peers: forget those not heard of for an interval
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.interval}
        more = (f" ({count} more times in the last {now - last:.0f}s)"
                if count and last is not None else "")
        self.logger.log(level, msg + more, *args)
        self._seen[key] = (now, 0)
        return True


def peer_host(stream: trio.SocketStream) -> str:
    """The address a connection comes from (no port): what per-peer limits and logs count."""
    try:
        return str(stream.socket.getpeername()[0])
    except (OSError, AttributeError, IndexError, TypeError):
        return "?"


class _Open:
    """Connections open now, in all and per peer address."""

    def __init__(self) -> None:
        self.total = 0
        self.by_peer: dict[str, int] = {}

    def refusal(self, peer: str, limits: Limits) -> tuple[Hashable, str] | None:
        """(what to log it under, why) a new connection from `peer` is refused, or None. A
        full server is one condition (many addresses may hit it), a full peer one per peer."""
        if self.total >= limits.max_connections:
            return "full", f"too many connections ({self.total} open, the limit)"
        n = self.by_peer.get(peer, 0)
        if n >= limits.max_per_peer:
            return ("peer", peer), (f"too many connections from {peer} ({n} open, the limit "
                                    "per address)")
        return None

    def add(self, peer: str) -> None:
        self.total += 1
        self.by_peer[peer] = self.by_peer.get(peer, 0) + 1

    def remove(self, peer: str) -> None:
        self.total -= 1
        n = self.by_peer.pop(peer) - 1
        if n:
            self.by_peer[peer] = n


async def serve_listeners(handler: Callable[[trio.SocketStream], Awaitable[object]],
                          listeners: list[trio.SocketListener], limits: Limits,
                          logger: logging.Logger, *,
                          task_status: trio.TaskStatus[list[trio.SocketListener]]
                          = trio.TASK_STATUS_IGNORED) -> None:
    """trio.serve_listeners with `limits` (see the module docstring): run `handler(stream)` in
    a task of its own for each connection accepted, and close the stream when it returns."""
    opened = _Open()
    log_once = LogOnce(logger)
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept_loop, listener, nursery, handler, limits, opened,
                               log_once)
        task_status.started(listeners)


async def _accept_loop(listener: trio.SocketListener, nursery: trio.Nursery,
                       handler: Callable[[trio.SocketStream], Awaitable[object]],
                       limits: Limits, opened: _Open, log_once: LogOnce) -> None:
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as e:
                if e.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                # The connection waits in the listen backlog; a descriptor freed by a
                # connection ending (or dropped for its handshake timeout) lets it in.
                log_once("accept", logging.WARNING,
                         "cannot accept connections: %s (%s) with %d connections open; "
                         "retrying every %gs", errno.errorcode[e.errno], os.strerror(e.errno),
                         opened.total, ACCEPT_RETRY)
                await trio.sleep(ACCEPT_RETRY)
                continue
            peer = peer_host(stream)
            refused = opened.refusal(peer, limits)
            if refused is not None:
                key, why = refused
                log_once(key, logging.WARNING, "refusing connections: %s", why)
                await refuse(stream, why)
                continue
            opened.add(peer)
            nursery.start_soon(_run_handler, stream, handler, opened, peer)


async def _run_handler(stream: trio.SocketStream,
                       handler: Callable[[trio.SocketStream], Awaitable[object]],
                       opened: _Open, peer: str) -> None:
    try:
        await handler(stream)
    finally:
        opened.remove(peer)
        await trio.aclose_forcefully(stream)
