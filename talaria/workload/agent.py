"""What an agent sends: the calls of a trace session as API requests.

Shared by the live replay and the simulator so both issue the same calls. The
trace's `output_tokens` travels only as the sim engine's stopping point and the
tool gap is never sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from talaria.workload.trace import TraceSession, session_prompts

DEFAULT_MAX_TOKENS = 4096  # what a coding agent typically asks for per call


@dataclass(frozen=True, slots=True)
class PlannedCall:
    index: int
    prompt_tokens: int
    prefix_tokens: int
    new_input_tokens: int
    max_tokens: int
    sim_stop_tokens: int  # engine-only: the model's own stopping point
    compact: bool
    tool_s: float         # agent-only: how long the tool runs after the reply


def plan_session(session: TraceSession, max_tokens: int = DEFAULT_MAX_TOKENS,
                 context_limit: int | None = None) -> list[PlannedCall]:
    """With `context_limit`, each call asks for at most what fits beside its prompt,
    as an agent must (the client refuses prompt + max_tokens over the limit). Only
    calls within `max_tokens` of the limit change."""
    out: list[PlannedCall] = []
    for i, (call, (prompt, prefix)) in enumerate(zip(session.calls, session_prompts(session))):
        out.append(
            PlannedCall(
                index=i,
                prompt_tokens=prompt,
                prefix_tokens=prefix,
                new_input_tokens=call.new_input_tokens,
                max_tokens=max(min(max_tokens, context_limit - prompt) if context_limit else max_tokens, 1),
                sim_stop_tokens=call.output_tokens,
                compact=call.compact,
                tool_s=call.tool_s if i < len(session.calls) - 1 else 0.0,
            )
        )
    return out


def call_id_for(session_id: str, index: int, run_tag: str = "") -> str:
    """Deterministic ids so a retried call keeps its id."""
    return f"{run_tag}{session_id}#{index:03d}"
