"""Pure: which of an engine's streamed tokens reach an agent whose stream has already begun.

An engine-worker that dies or is restarted mid-call leaves the call to be run again
from its first output token: its tokens come again from index 0. The agent client keeps
the re-run (it replaces what it had from that index on), but an HTTP stream cannot take
back what it sent, and relaying the re-run wrote the reply's text twice into one 200 (a
probe: 18,376 characters where 16,000 were due). Here a re-run is checked against what
was sent: while it repeats it (a deterministic engine, greedy decoding) nothing is
relayed, and once it goes past it only the new part is, so the agent sees one reply.
Where it differs (sampling) the stream cannot be made whole: RerunDiverged, and the
agent is told so with an error it can retry on, never a spliced reply.

Tokens lost on the way (published while the gateway's NATS connection was away: its
client asks for the call again once back, and the engine goes on from where it is)
leave a hole the stream cannot fill as it goes: nothing more is relayed, and the
reply's text brings the rest, as for a stream whose text was held. Relaying past the
hole, as before, gave the agent a reply with the lost tokens' words missing."""

from __future__ import annotations

from shared.schema import CallTokens


class RerunDiverged(Exception):
    """A re-run's tokens or text differ from those the stream already sent."""


class StreamedTokens:
    """The output tokens (and their text) sent on one stream so far, and a re-run's, if one came."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._text: list[str] = []  # (pieces, joined when a re-run is checked: not copied at every token)
        self.rerun: tuple[list[int], str] | None = None
        self.gapped = False  # tokens were lost on the way: nothing more relayed (a re-run from 0 mends it)

    def accept(self, ev: CallTokens) -> CallTokens | None:
        """What of `ev` to relay: itself, nothing (a re-run repeating what was sent, or past
        a hole), or a re-run's part past what was sent; RerunDiverged where a re-run differs."""
        if self.rerun is None and ev.index >= len(self.ids):
            if ev.index > len(self.ids) or self.gapped:  # (tokens lost on the way: the reply brings the rest)
                self.gapped = True
                return None
            self.ids.extend(ev.token_ids)
            self._text.append(ev.text or "")
            return ev
        if ev.index == 0:  # a re-run begins (again)
            self.rerun = ([], "")
        if self.rerun is None or ev.index != len(self.rerun[0]):
            raise RerunDiverged(f"tokens from index {ev.index} after {len(self.ids)} were sent")
        ids, text = self.rerun[0] + ev.token_ids, self.rerun[1] + (ev.text or "")
        if len(ids) <= len(self.ids):
            if ids != self.ids[:len(ids)] or not self.text.startswith(text):
                raise RerunDiverged(f"a re-run's first {len(ids)} tokens differ from those sent")
            self.rerun = (ids, text)
            return None
        if ids[:len(self.ids)] != self.ids or not text.startswith(self.text):
            raise RerunDiverged(f"a re-run differs from the {len(self.ids)} tokens sent")
        past = CallTokens(call_id=ev.call_id, index=len(self.ids), token_ids=ids[len(self.ids):],
                          text=text[len(self.text):] if ev.text is not None else None)
        self.ids, self.text, self.rerun, self.gapped = ids, text, None, False
        return past

    @property
    def text(self) -> str:
        """The text sent so far."""
        if len(self._text) != 1:
            self._text = ["".join(self._text)]
        return self._text[0]

    @text.setter
    def text(self, value: str) -> None:
        self._text = [value]
