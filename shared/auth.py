"""Who may do what on the bus and in the store (pure; no I/O).

One NATS user per role, each allowed only the subjects its role needs
(allow-lists: anything not listed is refused by the server); agents may only
send API requests and receive replies under their own reply namespace. Redis
gets one ACL user with a password whose keys are limited to the deployment's
prefix. The embedded stack generates fresh passwords at every start and hands
each child only its own; compose takes them from an env file.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from shared.subjects import AGENT_FACING_NAMESPACES, AGENT_NAMESPACE, GATEWAY_NAMESPACE, Subjects, inbox_prefix

ROLES = ("router", "admission", "substrate", "engine", "agent", "gateway", "operator")
AGENT_REPLY_NAMESPACE = AGENT_NAMESPACE

# what every service needs to be a NATS micro service and to make requests
_SERVICE_SUB = ["$SRV.>", "_INBOX.>"]
_SERVICE_PUB = ["_INBOX.>"]  # (health checks inside a service's container ping with its own user)


def _call_record_api(prefix: str) -> list[str]:
    """JetStream API subjects to open and read the call record bucket (its stream is KV_<bucket>)
    and to set its bound (whichever process opens it first)."""
    stream = f"KV_{Subjects(prefix).call_record_bucket}"
    return [f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.UPDATE.{stream}", f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>"]


def _prompt_store_api(prefix: str, namespace: str, *, write: bool = False, read: bool = False,
                      create: bool = False) -> list[str]:
    """JetStream subjects for one namespace's prompt store (its stream is OBJ_<bucket>):
    `write` puts objects (an agent), `read` reads and deletes them (an engine), `create`
    makes the bucket (the router)."""
    bucket = Subjects(prefix).prompt_bucket(namespace)
    stream = f"OBJ_{bucket}"
    out = [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}"]
    if create:
        out.append(f"$JS.API.STREAM.CREATE.{stream}")
    if write or read:  # a put purges the chunks it replaces; a delete purges its own
        out += [f"$JS.API.STREAM.PURGE.{stream}", f"$O.{bucket}.M.>"]
    if write:
        out.append(f"$O.{bucket}.C.>")
    if read:  # a get reads the chunks through an ordered consumer
        out += [f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
                f"$JS.API.CONSUMER.DELETE.{stream}.>", f"$JS.API.CONSUMER.INFO.{stream}.>"]
    return out


def _agent_permissions(prefix: str, namespace: str) -> dict[str, list[str]]:
    s = Subjects(prefix)
    return {"subscribe": [f"{s.reply_namespace(namespace)}.>", f"{inbox_prefix(namespace)}.>"],
            "publish": [*s.api_publish(namespace), *_prompt_store_api(prefix, namespace, write=True)]}


def nats_permissions(prefix: str) -> dict[str, dict[str, list[str]]]:
    p = prefix
    health = Subjects(prefix).health_all
    service_pub = [*_SERVICE_PUB, health]
    records_read = _call_record_api(p)
    records_write = [*records_read, f"$KV.{Subjects(p).call_record_bucket}.>"]  # placing, claiming, answering
    prompts_create = [x for ns in AGENT_FACING_NAMESPACES for x in _prompt_store_api(p, ns, create=True)]
    prompts_read = [x for ns in AGENT_FACING_NAMESPACES for x in _prompt_store_api(p, ns, read=True)]
    prompts_read += ["$JS.API.STREAM.NAMES", "$JS.FC.>"]  # (an ordered consumer finds its stream, answers flow control)
    return {
        "router": {
            "subscribe": [f"{p}.api.>", Subjects(p).call_move, health, *_SERVICE_SUB],
            "publish": [f"{p}.admission.*.submit", f"{p}.reply.>", Subjects(p).session_released, *service_pub,
                        *records_write, *prompts_create],
        },
        "admission": {
            "subscribe": [f"{p}.admission.*.submit", f"{p}.events.>", Subjects(p).call_cancel_any, health,
                          *_SERVICE_SUB],
            "publish": [f"{p}.engine.>", f"{p}.substrate.>", f"{p}.reply.>", Subjects(p).session_released,
                        Subjects(p).call_move, *service_pub,
                        # its epoch (shared/call_record.py) is the only record it writes
                        *records_read, f"$KV.{Subjects(p).call_record_bucket}.epoch.admission.>"],
        },
        "substrate": {
            "subscribe": [f"{p}.substrate.>", f"{p}.events.>", health, *_SERVICE_SUB],
            "publish": [f"{p}.engine.>", f"{p}.events.*.substrate", *service_pub],
        },
        "engine": {
            "subscribe": [f"{p}.engine.>", Subjects(p).call_cancel_any, Subjects(p).session_released, health, *_SERVICE_SUB],
            "publish": [f"{p}.reply.>", f"{p}.events.>", *service_pub, *records_write, *prompts_read],
        },
        # agents and the HTTP gateway (an agent of Talaria for all its tenants) each in a
        # namespace of their own: requests under it, replies and inboxes under it only
        "agent": _agent_permissions(prefix, AGENT_NAMESPACE),
        "gateway": _agent_permissions(prefix, GATEWAY_NAMESPACE),
        # health checks and the replay's own bookkeeping
        "operator": {
            "subscribe": ["_INBOX.>"],
            "publish": [health, "$SRV.>", f"{p}.api.info"],
        },
    }


def role_password_var(role: str) -> str:
    """The environment variable holding a role's NATS password in a deployment
    (compose reads them from its env file; see .env.example)."""
    return f"TALARIA_NATS_PASSWORD_{role.upper()}"


def nats_password_from_env(user: str | None, env: "dict[str, str]") -> str | None:
    """TALARIA_NATS_PASSWORD, else the user's role variable."""
    if env.get("TALARIA_NATS_PASSWORD"):
        return env["TALARIA_NATS_PASSWORD"]
    if user:
        return env.get(role_password_var(user)) or None
    return None


def render_nats_authorization(prefix: str, passwords: "dict[str, str]") -> str:
    """A nats-server `authorization` block: one user per role with its allow-lists.
    `passwords` maps role -> literal password, or a `$VARIABLE` reference that
    nats-server resolves from its environment."""

    def q(x: str) -> str:
        return '"' + x.replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = ["authorization {", "  users: ["]
    for role, perm in nats_permissions(prefix).items():
        pw = passwords[role]
        pw_text = pw if pw.startswith("$") else q(pw)
        pub = ", ".join(q(x) for x in perm["publish"])
        sub = ", ".join(q(x) for x in perm["subscribe"])
        lines.append(f"    {{user: {q(role)}, password: {pw_text},")
        lines.append(f"     permissions: {{publish: {{allow: [{pub}]}}, subscribe: {{allow: [{sub}]}}}}}}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Credentials:
    nats: dict[str, str]      # role -> password
    redis_user: str
    redis_password: str

    def nats_users(self) -> list[tuple[str, str]]:
        return list(self.nats.items())


def generate_credentials() -> Credentials:
    return Credentials(
        nats={role: secrets.token_urlsafe(18) for role in ROLES},
        redis_user="talaria",
        redis_password=secrets.token_urlsafe(18),
    )
