"""How many API requests one gateway answers at once: its own bound and each tenant's.

Pure bookkeeping, no I/O: the gateway asks `refusal` before it reads a request's
body, `take`s a slot for the request it answers and `give_back`s it when the
answer (a stream: its last event) is done. A request over a bound is refused at
once, before its body is read or anything is sent on the bus, as no capacity
(the gateway's bound: 429, Anthropic's 529 overloaded) or as a rate limit (the
tenant's bound: 429), both with `Retry-After`, which the SDKs wait out.

Why a bound: every request in flight costs the gateway's one event loop its
share of each relayed token; past some thousands of concurrent streams the loop
lags for seconds, its health check goes unanswered and its liveness watch kills
it with every stream it held. Refusing the excess early keeps the requests it
does hold served. The tenant's bound keeps one tenant's flood from taking every
slot of a gateway that others share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GATEWAY_FULL = "gateway"  # the gateway's own bound is reached (whoever asks)
TENANT_FULL = "tenant"    # the asking tenant holds its own bound


@dataclass
class CallSlots:
    most: int              # requests in flight at once (0: no bound)
    most_per_tenant: int   # ... of one tenant (0: none but the gateway's)
    held: int = 0
    held_by_tenant: dict[str, int] = field(default_factory=dict)

    def refusal(self, tenant: str) -> str | None:
        """Which bound a request of `tenant` is over now (GATEWAY_FULL, TENANT_FULL), else None."""
        if self.most and self.held >= self.most:
            return GATEWAY_FULL
        if self.most_per_tenant and self.held_by_tenant.get(tenant, 0) >= self.most_per_tenant:
            return TENANT_FULL
        return None

    def take(self, tenant: str) -> None:
        self.held += 1
        self.held_by_tenant[tenant] = self.held_by_tenant.get(tenant, 0) + 1

    def give_back(self, tenant: str) -> None:
        self.held -= 1
        left = self.held_by_tenant[tenant] - 1
        if left:
            self.held_by_tenant[tenant] = left
        else:  # (a tenant with nothing in flight takes no room: keys may be many)
            del self.held_by_tenant[tenant]
