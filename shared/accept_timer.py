"""How long an agent waits for a call's first answer before sending it again.

A call taken by a router that then hangs or dies is answered by nobody: NATS
delivered it, so no 503 comes back, and without this the agent heard of it only
when its silence timer fired (seconds). The first answer (`CallReceived`, which
a router sends as it takes a call, before placing it) comes within a bus hop and
the router's loop lag, so a call unanswered for a few times that latency is sent
again under the same call id (the router deduplicates it by the call record).
A fixed threshold is wrong under overload, when every answer is late and
resending all of them doubles the router's work; so the wait is TCP's retransmission timeout (RFC 6298) over the answers this
client has seen: smoothed latency plus four deviations, never under
`floor_s`, doubled for each resend of one call, and latencies of resent calls
are not sampled (Karn's rule: which send was answered is unknown).

Pure logic, no I/O: the client feeds it latencies and asks it for waits.
"""

from __future__ import annotations

from dataclasses import dataclass

ACCEPT_WAIT_FLOOR_S = 1.0  # never resend sooner than this (wall seconds)
_ALPHA, _BETA, _K = 1 / 8, 1 / 4, 4  # RFC 6298's gains and deviation multiplier


@dataclass(slots=True)
class AcceptTimer:
    floor_s: float = ACCEPT_WAIT_FLOOR_S
    ceiling_s: float = 60.0
    smoothed_s: float | None = None
    deviation_s: float = 0.0

    def observe(self, latency_s: float) -> None:
        """A first answer `latency_s` after a call's only send."""
        latency_s = max(0.0, latency_s)
        if self.smoothed_s is None:
            self.smoothed_s, self.deviation_s = latency_s, latency_s / 2
            return
        self.deviation_s = (1 - _BETA) * self.deviation_s + _BETA * abs(self.smoothed_s - latency_s)
        self.smoothed_s = (1 - _ALPHA) * self.smoothed_s + _ALPHA * latency_s

    def wait_s(self, resends: int = 0) -> float:
        """How long to wait for the first answer after a call's send number `resends` + 1."""
        base = self.floor_s if self.smoothed_s is None else self.smoothed_s + _K * self.deviation_s
        return min(self.ceiling_s, max(self.floor_s, base) * 2 ** resends)
