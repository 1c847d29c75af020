"""Hung processes are faults too: a service that stops answering its health
endpoint (stopped by SIGSTOP, a stuck driver, a full disk) while its process
still runs is killed, so the supervisor restarts it like a crashed one.

`LivenessWatch` is the decision (pure; stepped by each round of health pings
and the wall clock): a child is judged once it has answered since its start
and its grace has passed (a real engine loading its weights blocks its loop
for seconds), or, if it never answered, once its start-up allowance has
passed (a process that hangs before its first answer is caught too), and only
after `misses` rounds in a row without an answer. The embedded stack and the
container watchdog drive it (`talaria/ops/stack.py`, `talaria/ops/watchdog.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

LIVENESS_INTERVAL_S = 0.25  # wall seconds between two rounds of health pings
LIVENESS_TIMEOUT_S = 0.3    # wall seconds a ping may take (a served ping takes about 1 ms)
GATEWAY_LIVENESS_MISSES = 12  # the gateway's (as compose gives it): a kill cuts every stream it relays
# the gateway's ping (GET /health) may take seconds: a loop busy relaying a thousand streams answers
# in about half a second, and at the services' 0.3 s it was killed as hung, cutting every stream
# (a hung one is killed about 6 s after it stops answering)
GATEWAY_LIVENESS_TIMEOUT_S = 3.0
LIVENESS_MISSES = 3         # rounds in a row without an answer before a kill (about 1 s of silence: rounds
                            # start every interval, each judged when its pings answer or time out)
LIVENESS_TICK_S = 0.05      # wall seconds between two looks at the rounds out (a finished one is judged then)
STARTUP_GRACE_S = 300.0     # wall seconds after a (re)start in which a child is never judged (a real engine loads its weights)
SERVICE_GRACE_S = 2.0       # ... for every other child (a sim service answers within a second of its start)
SERVICE_STARTUP_S = 10.0    # ... and, if it has not answered since its start, this long (a loaded machine starts slowly)
BUS_SETTLE_S = 5.0          # wall seconds after the bus was away in which no round is judged: the services reconnect
                            # (a client whose keep-alive gave up on the node) and work off what queued meanwhile


@dataclass(frozen=True)
class Allowance:
    """How long a child is left alone after a (re)start, and how many rounds it may miss."""
    grace_s: float
    startup_s: float  # a child that never answered is judged this long after its start
    misses: int


@dataclass
class LivenessWatch:
    misses: int = LIVENESS_MISSES
    grace_s: float = STARTUP_GRACE_S
    startup_s: float = STARTUP_GRACE_S  # a child that never answered is judged this long after its start
    allowances: dict[str, Allowance] = field(default_factory=dict)  # children of their own allowances
    started_at: dict[str, float] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)   # answered since its (re)start
    missed: dict[str, int] = field(default_factory=dict)

    def allow(self, name: str, grace_s: float, startup_s: float, misses: int | None = None) -> None:
        """A child of its own allowances (a real engine's weight load among quick services;
        the gateway's longer patience, its streams being agents' own)."""
        self.allowances[name] = Allowance(grace_s, startup_s, self.misses if misses is None else misses)

    def started(self, name: str, at: float) -> None:
        """The child (re)started at wall time `at`: not judged until it answers and its grace is over."""
        self.started_at[name] = at
        self.answered.discard(name)
        self.missed.pop(name, None)

    def round(self, answers: dict[str, bool | None], now: float) -> list[str]:
        """One round of pings (name -> answered, or None: nobody listens on its health
        subject or port, so it is starting or stopping, not hung) at wall time `now`;
        returns the children to kill. A hung process keeps its subscription and its
        listener, so its ping goes unanswered (False); one that has let them go on purpose
        (a drained service tearing down, a gateway between its listener and its exit) was
        killed as hung after 1 s."""
        kill = []
        for name, ok in answers.items():
            if ok is None:
                continue
            if ok:
                self.answered.add(name)
                self.missed.pop(name, None)
                continue
            age = now - self.started_at.get(name, now)
            allowed = self.allowances.get(name) or Allowance(self.grace_s, self.startup_s, self.misses)
            if age < (allowed.grace_s if name in self.answered else max(allowed.grace_s, allowed.startup_s)):
                continue
            self.missed[name] = self.missed.get(name, 0) + 1
            if self.missed[name] >= allowed.misses:
                kill.append(name)
                self.started(name, now)  # judged again once the restarted one answers
        return kill


class PingRounds:
    """Rounds of health pings on a fixed cadence: a round begins every interval beside
    the rounds whose pings are still out (a hung child's ping waits out its timeout),
    and finished rounds come back in the order they began, so a hang is judged
    misses x interval + timeout after it began, not misses x (interval + timeout).

    A round may carry a probe of the watcher's own path (its NATS node answers a PING):
    a round whose probe failed says nothing of the children, since their pings went
    through a path that was away (a stopped NATS node keeps its connections open, so
    the client still looks connected), and it is dropped instead of judged. So is a
    round in which every one of two or more children missed at once: a bus stalled for
    all of them (a node stopped for a few seconds, whose PING the probe caught as it
    came back), or a machine too loaded to answer in time, not each one hung; a
    restart would not help either. And the bus having been away, the rounds begun in
    the next `settle_s` are dropped too: each service's client reconnects, and works off
    what queued meanwhile, before its pings are answered in time again (a 6-s stop of
    `talaria up`'s NATS had every service killed as it came back)."""

    def __init__(self, settle_s: float = BUS_SETTLE_S, off_bus: frozenset[str] = frozenset()) -> None:
        self._rounds: deque[tuple[asyncio.Future, list[str], bool, float]] = deque()
        self.dropped = 0  # rounds dropped: the watcher's own path away, or every child silent at once
        self.settle_s = settle_s
        self.off_bus = off_bus  # children pinged by another path (the gateway's HTTP): not in "every child silent"
        self.away_until = float("-inf")  # (monotonic) rounds begun before this are not judged

    def begin(self, names: list[str], ping: Callable[[str], Awaitable[bool | None]],
              probe: Callable[[], Awaitable[bool]] | None = None) -> None:
        pings = asyncio.gather(*(ping(n) for n in names), *([probe()] if probe is not None else []))
        # a round cut short at shutdown (its pings cancelled) is nobody's error to log
        pings.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._rounds.append((pings, names, probe is not None, time.monotonic()))

    def bus_away(self) -> None:
        """The bus is away now (the watcher's own client reconnecting): nothing out or begun
        within `settle_s` of now is judged."""
        self.away_until = time.monotonic() + self.settle_s

    def finished(self) -> list[dict[str, bool | None]]:
        """The answers (name -> answered) of every round done, oldest first, until one is
        not; a round of the bus's fault (above) is left out."""
        out = []
        while self._rounds and self._rounds[0][0].done():
            done, names, probed, began = self._rounds.popleft()
            answers = done.result()
            judged = [ok for name, ok in zip(names, answers) if ok is not None and name not in self.off_bus]
            if (probed and not answers[-1]) or (len(judged) >= 2 and not any(judged)):
                self.bus_away()
                self.dropped += 1
                continue
            if began < self.away_until:
                self.dropped += 1
                continue
            out.append(dict(zip(names, answers)))
        return out

    def drop(self) -> None:
        """Forget the rounds still out (their misses are our own disconnection's)."""
        for pending, _, _, _ in self._rounds:
            pending.cancel()
        self._rounds.clear()


PROBE_FLUSH_S = 60.0  # how long one probe's PING may wait for its PONG inside nats-py (never cut short by us)


class BusProbe:
    """The watcher's own NATS node answers a PING (`PingRounds`' probe): if not, its
    health pings are unanswered for its own sake, not the children's.

    One PING at a time, and never cancelled while its PONG may still come: nats-py's
    `flush(timeout)` cancels the PONG's future on a timeout but leaves it queued, and the
    late PONG (a node resuming after a stop of a second or more) then kills the client's
    read loop (`InvalidStateError`) while it still reads as connected; its `flush` then
    returns at once, so the probe said the bus was fine while every health ping timed
    out, and a 1-4 s stop of `talaria up`'s NATS had every service killed. A round's probe
    waits at most `timeout_s` on the PING in flight; a dead read loop is "away" too, until
    the client's keep-alive reconnects it."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self._flight: asyncio.Future[bool] | None = None
        self._flight_reconnects = -1

    async def answers(self, timeout_s: float = LIVENESS_TIMEOUT_S) -> bool:
        nc = self.nc
        if nc.is_closed or not nc.is_connected:
            return False
        reading = getattr(nc, "_reading_task", None)  # (nats-py's; a client whose read loop died hears nothing)
        if reading is None or reading.done():
            return False
        reconnects = nc.stats.get("reconnects", 0)
        if self._flight is None or self._flight.done() or reconnects != self._flight_reconnects:
            # (a PING of a connection since replaced is left to run out: its PONG will not come)
            self._flight, self._flight_reconnects = asyncio.ensure_future(self._ping()), reconnects
        try:
            return await asyncio.wait_for(asyncio.shield(self._flight), timeout_s)
        except Exception:  # noqa: BLE001 - no PONG yet: away
            return False

    async def _ping(self) -> bool:
        try:
            await self.nc.flush(timeout=PROBE_FLUSH_S)
            return True
        except Exception:  # noqa: BLE001 - stopped, partitioned, reconnecting: all "away"
            return False

    def close(self) -> None:
        if self._flight is not None:
            self._flight.cancel()
