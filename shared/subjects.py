"""Every NATS subject Talaria uses, in one place.

Subjects carry a deployment prefix (TALARIA_SUBJECT_PREFIX, default
"talaria") so an embedded stack or a test never crosses another's traffic.
Admission, substrate and engine subjects are sharded by server id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

AGENT_NAMESPACE = "agent"       # agents on NATS (the `agent` user of an authenticated deployment)
GATEWAY_NAMESPACE = "gateway"   # the HTTP gateway, an agent of Talaria for all its tenants
AGENT_FACING_NAMESPACES = (AGENT_NAMESPACE, GATEWAY_NAMESPACE)
_NAMESPACE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_namespace(name: str) -> bool:
    return bool(_NAMESPACE.fullmatch(name))


def inbox_prefix(namespace: str) -> str:
    """The request-reply inbox prefix of an agent-facing user (nats-py `inbox_prefix`):
    its user may subscribe to its own inboxes only."""
    return f"_INBOX.{namespace}"


@dataclass(frozen=True, slots=True)
class Subjects:
    prefix: str = "talaria"

    # agent API (router queue group). An agent-facing NATS user (an agent, the gateway)
    # publishes under its own namespace and hears replies only under it; the NATS
    # server enforces that by permission, the router and engines by ownership.
    def api_call(self, namespace: str = AGENT_NAMESPACE) -> str:
        return f"{self.prefix}.api.{namespace}.call"

    def api_session_open(self, namespace: str = AGENT_NAMESPACE) -> str:
        return f"{self.prefix}.api.{namespace}.session.open"

    def api_session_end(self, namespace: str = AGENT_NAMESPACE) -> str:
        return f"{self.prefix}.api.{namespace}.session.end"

    def call_cancel(self, namespace: str = AGENT_NAMESPACE) -> str:
        """An agent gave up on a call (CancelCall); the engine running it aborts it."""
        return f"{self.prefix}.api.{namespace}.cancel"

    @property
    def api_requests(self) -> list[str]:
        """What the router listens on: every namespace's calls and session requests, and info."""
        return [self.api_call("*"), self.api_session_open("*"), self.api_session_end("*"), self.api_info]

    @property
    def call_cancel_any(self) -> str:
        return self.call_cancel("*")

    def api_namespace(self, subject: str) -> str | None:
        """The namespace an API subject was published under (None: not one of them)."""
        head = f"{self.prefix}.api."
        if not subject.startswith(head):
            return None
        ns = subject[len(head):].split(".", 1)[0]
        return ns if is_namespace(ns) and ns != "info" else None

    @property
    def api_info(self) -> str:
        return f"{self.prefix}.api.info"

    def api_publish(self, namespace: str) -> list[str]:
        """What an agent-facing user of `namespace` may publish."""
        return [f"{self.prefix}.api.{namespace}.>", self.api_info]

    def reply_namespace(self, namespace: str) -> str:
        """The reply subjects of one namespace: `<this>.<client>.<call>`."""
        return f"{self.prefix}.reply.{namespace}"

    def reply_inbox(self, client_id: str, call_id: str) -> str:
        return f"{self.prefix}.reply.{client_id}.{_token(call_id)}"

    def is_reply_inbox(self, subject: str, namespace: str | None = None) -> bool:
        """A subject in the agents' reply namespace (where a service may answer a request
        it could not read); with `namespace`, in that namespace's part of it."""
        head = f"{self.reply_namespace(namespace)}." if namespace else f"{self.prefix}.reply."
        return subject.startswith(head) and not any(c in subject for c in " \t\r\n*>")

    # admission, one per server
    def admission_submit(self, server: str) -> str:
        return f"{self.prefix}.admission.{server}.submit"

    @property
    def call_move(self) -> str:
        """MoveCall: an admission hands a call back to the routers to place elsewhere."""
        return f"{self.prefix}.router.move"

    # substrate-manager, one per server
    def substrate_switch(self, server: str) -> str:
        return f"{self.prefix}.substrate.{server}.switch"

    def substrate_stage(self, server: str) -> str:
        return f"{self.prefix}.substrate.{server}.stage"

    # engine-worker, one per (server, model)
    def engine_run(self, server: str, model: str) -> str:
        return f"{self.prefix}.engine.{server}.{_token(model)}.run"

    def engine_control(self, server: str, model: str) -> str:
        return f"{self.prefix}.engine.{server}.{_token(model)}.control"

    def engine_reset_kv(self, server: str, model: str) -> str:
        """An operator's (and the tests') hook: clear a real engine's prefix cache."""
        return f"{self.prefix}.engine.{server}.{_token(model)}.control.reset_kv"

    # health: every service process answers on its own instance's subject
    def health(self, instance: str) -> str:
        return f"{self.prefix}.health.{instance}"

    @property
    def health_all(self) -> str:
        """Every instance's health subject (for a permission or a monitor)."""
        return f"{self.prefix}.health.>"

    # events
    def call_finished(self, server: str) -> str:
        return f"{self.prefix}.events.{server}.finished"

    def engine_announce(self, server: str) -> str:
        return f"{self.prefix}.events.{server}.engine"

    def engine_draining(self, server: str) -> str:
        """EngineDraining: an engine-worker of the server stops taking runs."""
        return f"{self.prefix}.events.{server}.engine_draining"

    def kv_events(self, server: str) -> str:
        """KV-cache events of the server's real engines (KvBlocksStored/Removed/AllCleared)."""
        return f"{self.prefix}.events.{server}.kv"

    def kv_spilled(self, server: str) -> str:
        """The active engine spilled idle KV to host DRAM (KvSpilled), for the substrate's ledger."""
        return f"{self.prefix}.events.{server}.kv_spilled"

    def substrate_announce(self, server: str) -> str:
        return f"{self.prefix}.events.{server}.substrate"

    @property
    def session_released(self) -> str:
        """SessionReleased: an agent ended a session, or admission released an idle one."""
        return f"{self.prefix}.events.session_released"

    def prompt_bucket(self, namespace: str) -> str:
        """The JetStream object store of one namespace's prompts sent by reference
        (shared/prompt_store.py); its stream is `OBJ_<bucket>`, its subjects `$O.<bucket>.>`."""
        return self._bucket_base() + "_prompts_" + namespace

    def _bucket_base(self) -> str:
        return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in self.prefix)

    @property
    def call_record_bucket(self) -> str:
        """The JetStream KV bucket of the at-most-once call record (shared/call_record.py);
        its stream is `KV_<bucket>`, its subjects `$KV.<bucket>.<key>`."""
        return self._bucket_base() + "_calls"


def _token(name: str) -> str:
    """A model or call name as one subject token (no dots, spaces or wildcards)."""
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


# NATS headers that carry the trace context across services
HEADER_SESSION = "Talaria-Session"
HEADER_CALL = "Talaria-Call"
# on a call: the sender wants the router's receipt (`received`) first on the reply subject;
# a plain NATS request without it sees the call's answer (or its error) first, as before
HEADER_RECEIPT = "Talaria-Receipt"
