"""Per-call records and per-run summaries, shared by the replay and the simulator."""

from __future__ import annotations

import msgspec


class CallRecord(msgspec.Struct, kw_only=True):
    call_id: str
    session_id: str
    model: str
    index: int
    server_id: str = ""
    issued_at: float = 0.0     # model seconds since run start
    finished_at: float = 0.0
    waited_s: float = 0.0      # arrival at admission -> dispatch to the engine
    switch_wait_s: float = 0.0  # part of the wait spent in model switches
    round_wait: bool = False   # arrived during its model's open slot and missed it
    restore_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    restored_tokens: int = 0
    reprefill_tokens: int = 0
    output_tokens: int = 0
    attempts: int = 1
