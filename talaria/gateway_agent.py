"""A replayed trace's agents speaking HTTP to the gateway (`talaria replay --via-gateway`).

The same driver as the NATS replay (`talaria.replay.drive`) through the front door an
agent in use calls: each session is a conversation sent to `POST /v1/chat/completions`
under its `x-session-id`, each call's `Idempotency-Key` its call id (the services' logs
carry the id the gateway makes of that key, `gwc-...`; `talaria logs` finds a session by
its trace id, the agent's name for it). A trace carries
token counts, not text, so each call appends a user message of filler sized to bring
the conversation to the trace's prompt tokens (the gateway's stand-in count: four per
message and one per four bytes), and asks for the trace's output length through the
gateway's extension field (`talaria.sim_output_tokens`, an engine hint only the sim
engine reads). The reply is re-sent as the assistant's turn, as an agent does, so the
gateway's prefix identity, not the trace, says what the session's engine holds. A
compacted context (a prompt smaller than the conversation) starts a new conversation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp

from services.gateway import translate as tr
from services.gateway.prefix import MESSAGE_FRAME_TOKENS
from shared.schema import CallReply
from talaria.client import TalariaClient, TalariaError

if TYPE_CHECKING:
    from talaria.ops.stack import EmbeddedStack


# an HTTP status the official SDKs send again, as the agent client's code for it
RETRIED_STATUS = {408: "timeout", 429: "no_capacity", 500: "internal", 502: "unavailable", 503: "unavailable",
                  504: "timeout", 529: "no_capacity"}


def _seconds(header: str | None) -> float | None:
    """A `Retry-After` in seconds (its date form, which the gateway never sends, as absent)."""
    try:
        return max(0.0, float(header)) if header is not None else None
    except ValueError:
        return None


class GatewaySession:
    def __init__(self, http: aiohttp.ClientSession, base_url: str, api_key: str, model: str, session_id: str,
                 context_limit: int) -> None:
        self.http = http
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.headers = {"Authorization": f"Bearer {api_key}", "x-session-id": session_id}
        self.model = model
        self.session_id = session_id
        self.context_limit = context_limit
        self.messages: list[dict[str, Any]] = []
        self.tokens = 0  # the conversation's stand-in count (each message's depends on it alone)
        self.asking: str | None = None  # the call id whose user message is the conversation's last

    def _append(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})
        self.tokens += tr.chat_prompt(self.messages[-1:]).tokens

    def _grow_to(self, prompt_tokens: int, label: str) -> None:
        """Append a user message so the conversation counts `prompt_tokens` (or as close as the
        message framing allows); a prompt smaller than what is there starts anew (compaction)."""
        if prompt_tokens < self.tokens + MESSAGE_FRAME_TOKENS + 1:
            self.messages, self.tokens = [], 0
        size = 4 * max(1, prompt_tokens - self.tokens - MESSAGE_FRAME_TOKENS)
        self._append("user", (label + " " + "tool output " * (size // 12 + 1))[:size])

    async def call(self, *, prompt_tokens: int, prefix_tokens: int, max_tokens: int, call_id: str,
                   sim_output_tokens: int | None = None) -> CallReply:
        del prefix_tokens  # the gateway finds it from the conversation itself
        if self.asking != call_id:  # a retry sends the very same request (its Idempotency-Key's)
            self._grow_to(prompt_tokens, call_id)
            self.asking = call_id
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "messages": self.messages}
        if sim_output_tokens is not None:
            body[tr.EXTENSION_FIELD] = {"sim_output_tokens": min(sim_output_tokens, max_tokens)}
        try:
            async with self.http.post(self.url, json=body, headers={**self.headers, "Idempotency-Key": call_id}) as r:
                answer = await r.json(content_type=None)
        except (aiohttp.ClientError, ValueError) as exc:  # the gateway went away mid-call, or sent no JSON
            raise TalariaError("unavailable", f"the gateway did not answer: {exc!r}"[:300]) from None
        if r.status != 200:
            err = answer.get("error", {}) if isinstance(answer, dict) else {}
            # statuses an SDK retries read as the agent client's own codes (`drive`'s retries)
            code = RETRIED_STATUS.get(r.status) or str(err.get("code") or err.get("type") or r.status)
            raise TalariaError(code, str(err.get("message") or answer), retry_after_s=_seconds(r.headers.get("Retry-After")))
        text = answer["choices"][0]["message"].get("content") or ""
        self._append("assistant", text)
        usage = answer["usage"]
        return CallReply(
            call_id=call_id, session_id=self.session_id,
            server_id=str(answer.get("system_fingerprint", "")).removeprefix("talaria-"), model=self.model,
            prompt_tokens=usage["prompt_tokens"], cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
            restored_tokens=0, reprefill_tokens=0, output_tokens=usage["completion_tokens"], arrived_at=0.0,
            finished_at=0.0, waited_s=0.0, switch_wait_s=0.0, round_wait=False, restore_s=0.0, prefill_s=0.0,
            decode_s=0.0, text=text)

    async def end(self) -> None:
        """Nothing to send: an agent in use just stops calling (the router releases the idle session)."""


class GatewayAgents:
    """Opens each replayed session as a gateway conversation (what `drive` asks of a client)."""

    @classmethod
    async def of_stack(cls, stack: "EmbeddedStack", client: TalariaClient) -> "GatewayAgents":
        """The agents of an embedded stack's gateway, each model's context limit asked of its router."""
        assert stack.openai_base_url is not None
        return cls(stack.openai_base_url, stack.api_key, dict((await client.info()).context_limits))

    def __init__(self, base_url: str, api_key: str, context_limits: dict[str, int]) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.context_limits = context_limits
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def open_session(self, model: str, session_id: str) -> GatewaySession:
        return GatewaySession(self.http, self.base_url, self.api_key, model, session_id,
                              self.context_limits.get(model, 128_000))

    async def close(self) -> None:
        await self.http.close()
