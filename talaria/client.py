"""The agent SDK: `TalariaClient`, `Session`, `TokenSession` and the credentials
file (`Deployment`). The code is `shared/agent_client.py`, shared with the HTTP
gateway (services may not import `talaria`); this module is its public name.

    async with await TalariaClient.connect(["nats://127.0.0.1:4222"]) as client:
        session = await client.open_session("glm-4.5-fp8")
        reply = await session.call(prompt_tokens=8000, max_tokens=1024)
        await session.end()
"""

from shared.agent_client import (  # noqa: F401  (re-exported)
    _ERRORS, AgentLogin, CallTimeout, ContextLimit, Deployment, LoginRefused, Malformed, NoCapacity, Session,
    SessionEnded, TalariaClient, TalariaError, TokenSession, UnknownModel, UnknownSession, raise_for,
)

__all__ = [
    "AgentLogin", "CallTimeout", "ContextLimit", "Deployment", "LoginRefused", "Malformed", "NoCapacity", "Session",
    "SessionEnded", "TalariaClient", "TalariaError", "TokenSession", "UnknownModel", "UnknownSession", "raise_for",
]
