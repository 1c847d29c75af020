"""Every Redis key Talaria uses, in one place (cf. arq's constants module).

All keys sit under a deployment prefix (TALARIA_KEY_PREFIX) so an embedded
stack or a test has its own key space. Each key is tagged in `DURABILITY`:

- *soft*: a cache of what the services hold, rebuilt after a loss (the next
  mirror write, the workers' announcements and KV events, a session's next call);
- *must survive*: losing it loses work or breaks a promise to an agent (a call
  accepted but forgotten, a call answered twice, a session that vanishes).
  Run Redis with a replica (or persistence) where those matter.

The at-most-once record of each call (placed, claimed, answered) is not here:
it lives in a JetStream bucket replicated over the NATS cluster
(`shared/call_record.py`), because Redis replicates asynchronously.

The typed encode/decode of the shared hashes and who writes which field:
`shared/state.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CALL_TTL_S = 6 * 3600       # the call record (shared/call_record.py: dedupe, stored replies) outlives any replay
SESSION_TTL_S = 6 * 3600
# one Redis Cluster hash tag for the keys that placement reads and writes together
# (a router's compare-and-set, admission's mirror transaction): one slot, so the
# multi-key script and transaction work on a cluster as on one node
PLACEMENT_SLOT = "{placement}:"


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "talaria:"

    def session(self, session_id: str) -> str:
        """Hash: model, last_server, last_finish, gaps (JSON), outputs (JSON)."""
        return f"{self.prefix}session:{session_id}"

    def kv_locality(self, session_id: str) -> str:
        """Hash: server id -> tier (hbm|host) of the session's prefix."""
        return f"{self.prefix}kv:{session_id}"

    def kv_blocks(self, server_id: str, model: str) -> str:
        """Hash: block hash -> session id, every KV block a server's real engine
        reported stored (vLLM KV events) and has not removed since."""
        return f"{self.prefix}kvblocks:{server_id}:{model}"

    def kv_session_blocks(self, session_id: str, server_id: str) -> str:
        """Set: the block hashes of the session's prefix held on the server (from KV events)."""
        return f"{self.prefix}kv:{session_id}:blocks:{server_id}"

    def engine(self, server_id: str, model: str) -> str:
        """Hash: the engine's backend and state (starting|ready|draining; routers rank a server
        whose engine is starting or draining last for the model); a real engine's start-up
        wall seconds, KV block size and context limit."""
        return f"{self.prefix}engine:{server_id}:{model}"

    def server(self, server_id: str) -> str:
        """Hash: active model, staged model, queued, running, kv occupancy, reservations, live models.
        Written by the server's admission in one transaction with `in_flight`."""
        return f"{self.prefix}{PLACEMENT_SLOT}server:{server_id}"

    def placements(self) -> str:
        """String: a counter every router placement advances. A router writes a
        placement only if the counter is still what its ranking read (a Lua
        compare-and-set with the `in_flight` write), else it reads and ranks again,
        so two replicas never place on the same stale snapshot."""
        return f"{self.prefix}{PLACEMENT_SLOT}placements"

    def placement_log(self) -> str:
        """List: who made each of the most recent placements (router instance and call id),
        pushed by the same compare-and-set that advances `placements`. A replica's placement
        still lands when every placement since its snapshot is one its ranking already
        counted (its own), so a router's concurrent calls never make each other read again."""
        return f"{self.prefix}{PLACEMENT_SLOT}placement-log"

    def in_flight(self, server_id: str) -> str:
        """Hash: call id -> "model|prompt_tokens|placed_at" (wall seconds), every call
        a router replica placed on the server and the server's mirror does not count
        yet. The router writes it before it forwards the call; admission deletes it
        in the transaction that writes the mirror counting the call (or the router,
        when the server refuses it). Every router adds these to the mirror, so
        calls placed by several replicas within the mirror's latency see each other."""
        return f"{self.prefix}{PLACEMENT_SLOT}inflight:{server_id}"

    def reservation(self, session_id: str) -> str:
        """String "server|expires_at": the session's soft reservation. Made with
        SET NX (one claim per session, whichever admission is first), expiring
        in model time (PX = hold / time scale), released by compare-and-delete."""
        return f"{self.prefix}resv:{session_id}"

    def session_gaps(self, session_id: str) -> str:
        """List: the session's observed tool gaps (model seconds)."""
        return f"{self.prefix}session:{session_id}:gaps"

    def session_outputs(self, session_id: str) -> str:
        """List: the session's past output lengths."""
        return f"{self.prefix}session:{session_id}:outputs"

    def admission_sessions(self, server_id: str) -> str:
        """Hash: session id -> "<model time of its last arrival or finish here> <model>", every
        session admission would release when idle; reloaded when admission restarts (a session
        idle at the restart was otherwise never released: its KV and claim kept for hours)."""
        return f"{self.prefix}adm:{server_id}:sessions"

    def admission_calls(self, server_id: str) -> str:
        """Hash: call id -> encoded SubmitCall, every call admission accepted and
        has not seen finish (queued or running); reloaded when admission restarts."""
        return f"{self.prefix}adm:{server_id}:calls"

    def servers(self) -> str:
        """Set: known server ids."""
        return f"{self.prefix}servers"

    def lag(self, service: str) -> str:
        """String: worst event-loop lag (wall seconds) a service has seen."""
        return f"{self.prefix}lag:{service}"

    def stalled(self, service: str) -> str:
        """String: wall seconds a service's event loop has stalled since it started
        (its lags of at least `STALL_MIN_WALL_S`, summed)."""
        return f"{self.prefix}stalled:{service}"

    # -- the gateway's (services/gateway/prefix.py): any replica finds a session's prefix
    def gateway_chain(self, session_id: str) -> str:
        """String: what the session's engine holds after its last calls, as the chained block
        hashes (8 bytes each) of each branch's last prompt and reply, newest first, each
        after its block count (4 bytes; `prefix.pack_branches`)."""
        return f"{self.prefix}gw:branches:{session_id}"

    def gateway_open(self, tenant: str, model: str) -> str:
        """Hash: session id -> `blocks:tail-hash:updated_at`, the tenant's header-less
        sessions of a model, which a request naming no session is matched against."""
        return f"{self.prefix}gw:open:{tenant}:{model}"

    def gateway_busy(self, session_id: str) -> str:
        """String: the call id a header-less session runs now (set NX: one call at a time)."""
        return f"{self.prefix}gw:busy:{session_id}"

    def gateway_request(self, scope: str, request_hash: str) -> str:
        """String: the call id of a request's latest first attempt in a session (or a header-less scope): its SDK retries land there."""
        return f"{self.prefix}gw:req:{scope}:{request_hash}"

    def gateway_idempotency(self, key_digest: str) -> str:
        """String: the request (path and body hash) an `Idempotency-Key` was first sent with, per tenant."""
        return f"{self.prefix}gw:idem:{key_digest}"

    def gateway_call(self, call_id: str) -> str:
        """String: the session a header-less call was given, so its HTTP retry lands there too."""
        return f"{self.prefix}gw:call:{call_id}"

    def gateway_askers(self, call_id: str) -> str:
        """Set: the gateway replicas waiting for a call (their agent clients' ids), so the one
        that gives up cancels it only where no other still asks (a retry behind a load
        balancer lands on another replica)."""
        return f"{self.prefix}gw:askers:{call_id}"

    def gateway_replica(self, client_id: str) -> str:
        """String: a gateway replica that is up (its agent client's id), rewritten by its beat
        every few seconds with a short expiry: gone, its calls are no longer asked for by it."""
        return f"{self.prefix}gw:replica:{client_id}"

    def gateway_item(self, item_digest: str) -> str:
        """String: the stored response (its id) whose output holds an item (per tenant), for
        an `item_reference` to it (`translate.item_digest`)."""
        return f"{self.prefix}gw:item:{item_digest}"

    def gateway_response(self, response_digest: str) -> str:
        """String: a stored Responses-API response (per tenant): the response object and where
        the conversation it ends is (a thread and its length), compressed (`translate.stored_response`)."""
        return f"{self.prefix}gw:resp:{response_digest}"

    def gateway_thread(self, thread_id: str) -> str:
        """List: the items of stored Responses-API conversations, oldest first, each compressed
        (`translate.thread_item`): a response continuing the thread's last one appends its own,
        so a conversation is stored once, not once per response along it."""
        return f"{self.prefix}gw:thread:{thread_id}"


Durability = Literal["soft", "must-survive"]

DURABILITY: dict[str, Durability] = {
    "session": "must-survive",         # an open session (its model) and its call count
    "admission_calls": "must-survive", # calls accepted and not finished: a restarted admission reloads them
    "kv_locality": "soft",             # rebuilt from finishes and KV events
    "kv_blocks": "soft",               # rebuilt from the real engines' KV events
    "kv_session_blocks": "soft",
    "engine": "soft",                  # an engine-worker rewrites it at start-up (and a draining one its state)
    "server": "soft",                  # admission's and the substrate's mirrors rewrite it (counters restart from the survivors' totals)
    "placements": "soft",
    "in_flight": "soft",               # entries age out; a lost one only misses a moment's count
    "reservation": "soft",             # a soft claim that expires anyway
    "session_gaps": "soft",            # decision history: a lost history only weakens a prediction
    "session_outputs": "soft",
    "servers": "soft",                 # re-added by each admission at start-up
    "lag": "soft",
    # lost: the next call's prefix is taken as empty (the engine's own cache still
    # reuses what it holds) and a header-less conversation starts a new session
    "gateway_chain": "soft",
    "gateway_open": "soft",
    "gateway_busy": "soft",
    "gateway_request": "soft",         # (lost: an SDK retry becomes a call of its own)
    "gateway_idempotency": "soft",     # (lost: a key reused with another request is its own call, never refused)
    "gateway_call": "soft",            # (a retry after its loss is answered by the call record if its session matches again)
    "gateway_askers": "soft",          # (lost: a replica that gives up cancels the call, as one alone would)
    "gateway_replica": "soft",         # (lost: rewritten by the replica's next beat; meanwhile its calls may be cancelled)
    "gateway_thread": "soft",          # (lost: its responses are previous_response_not_found, as expired ones)
    "gateway_response": "soft",        # (lost: a continuation of it is previous_response_not_found, as an expired one)
    "gateway_item": "soft",            # (lost: a reference to the item is not found, as an expired one's)
}
