"""How many calls of a model one gateway answers at once: its own bound and each tenant's.

Pure bookkeeping, no I/O: the gateway asks for a slot before it reads a request's
body (`try_take`), and gives it back when the answer (a stream: its last event)
is done. A request over a bound waits in line for one (`wait`), first come first
served, up to the gateway's wait; a slot given back goes at once to the first
waiter whose bounds now allow it (`give_back` returns those it admitted), so a
request arriving meanwhile cannot take it from them. One that waited its time
out, or found the line full, is refused as no capacity (the gateway's bound:
429, Anthropic's 529 overloaded) or as a rate limit (the tenant's bound: 429),
both with `Retry-After`.

Why a bound: every request in flight costs the gateway's one event loop its
share of each relayed token; past some thousands of concurrent streams the loop
lags for seconds, its health check goes unanswered and its liveness watch kills
it with every stream it held. A request waiting for a slot costs its connection
alone. The tenant's bound keeps one tenant's flood from taking every slot of a
gateway that others share. Why a line: the SDKs retry a 429 twice, a second
apart, and give up: refused at once, a tenant's calls past its bound failed
whenever no slot came free within two seconds, and the retries that came first
took the slots freed, whoever had waited longest.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

GATEWAY_FULL = "gateway"  # the gateway's own bound is reached (whoever asks)
TENANT_FULL = "tenant"    # the asking tenant holds its own bound


@dataclass(eq=False)
class Waiter:
    """A request in line for a slot; `handle` is the gateway's own (what wakes it)."""
    tenant: str
    handle: Any = None
    granted: bool = False  # a slot was taken for it: it holds one from then on


@dataclass
class CallSlots:
    most: int              # requests in flight at once (0: no bound)
    most_per_tenant: int   # ... of one tenant (0: none but the gateway's)
    most_waiting: int = 0  # requests in line for a slot at once (0: none waits, each is refused at once)
    held: int = 0
    held_by_tenant: dict[str, int] = field(default_factory=dict)
    waiting: deque[Waiter] = field(default_factory=deque)

    def refusal(self, tenant: str) -> str | None:
        """Which bound a request of `tenant` is over now (TENANT_FULL, GATEWAY_FULL), else
        None; its own first, which holds whatever the others do."""
        if self.most_per_tenant and self.held_by_tenant.get(tenant, 0) >= self.most_per_tenant:
            return TENANT_FULL
        if self.most and self.held >= self.most:
            return GATEWAY_FULL
        return None

    def try_take(self, tenant: str) -> bool:
        """A slot for a request of `tenant` now, if its bounds allow one (then it holds it)."""
        if self.refusal(tenant) is not None:
            return False
        self._take(tenant)
        return True

    def wait(self, tenant: str, handle: Any = None) -> Waiter | None:
        """A place in line for a request over a bound, else None: the line is full, or the
        tenant holds as many places in it as its bound allows it slots (one tenant's flood
        would fill the line, and every other tenant's request over the gateway's bound was
        refused at once)."""
        if self.line_full(tenant):
            return None
        waiter = Waiter(tenant, handle)
        self.waiting.append(waiter)
        return waiter

    def give_back(self, tenant: str) -> list[Waiter]:
        """A slot of `tenant` back; the waiters it (and any other room) now admits, each
        holding its slot, first come first served."""
        self.held -= 1
        left = self.held_by_tenant[tenant] - 1
        if left:
            self.held_by_tenant[tenant] = left
        else:  # (a tenant with nothing in flight takes no room: keys may be many)
            del self.held_by_tenant[tenant]
        return self._admit()

    def leave(self, waiter: Waiter) -> list[Waiter]:
        """`waiter` stops waiting (its time is up, or its client left): out of line, and the
        slot it was granted meanwhile, if any, given back; the waiters that admits."""
        if waiter.granted:
            waiter.granted = False
            return self.give_back(waiter.tenant)
        if waiter in self.waiting:  # (not if refused with the rest: `refuse_all`)
            self.waiting.remove(waiter)
        return []

    def line_full(self, tenant: str) -> bool:
        """A request of `tenant` over a bound now would be refused at once, finding no place
        in line for it."""
        if len(self.waiting) >= self.most_waiting:
            return True
        return bool(self.most_per_tenant) and \
            sum(w.tenant == tenant for w in self.waiting) >= self.most_per_tenant

    def refuse_all(self) -> list[Waiter]:
        """Every waiter out of line (the gateway stops)."""
        out = list(self.waiting)
        self.waiting.clear()
        return out

    def _take(self, tenant: str) -> None:
        self.held += 1
        self.held_by_tenant[tenant] = self.held_by_tenant.get(tenant, 0) + 1

    def _admit(self) -> list[Waiter]:
        admitted = []
        for waiter in list(self.waiting):  # (in order: one whose tenant is at its bound lets the next pass)
            if self.most and self.held >= self.most:
                break
            if self.try_take(waiter.tenant):
                self.waiting.remove(waiter)
                waiter.granted = True
                admitted.append(waiter)
        return admitted
