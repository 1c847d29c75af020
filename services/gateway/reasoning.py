"""A thinking model's reasoning, read apart from its answer (pure; no I/O).

GLM-4.5 and Qwen3 write their thinking between `<think>` and `</think>` before the
answer (vLLM's `--reasoning-parser glm45` and `qwen3`). The gateway hands the answer
alone to the tool-call parser and to the agent as the reply's content, and the
reasoning apart from it, as each API carries reasoning: chat's `reasoning` field (vLLM's
name), Anthropic's `thinking` block, a Responses `reasoning` item. A reply that does not
open with `<think>` has no reasoning; one cut off before `</think>` is all reasoning.

- `split`: a whole reply's (reasoning, answer).
- `Splitter`: the same for a stream, token batch by token batch: what of each batch is
  reasoning and what is answer, holding back only what could still be a tag.
"""

from __future__ import annotations

from shared import harmony
from shared.catalog import REASONING_FORMATS

FORMATS = REASONING_FORMATS  # (the catalog's `reasoning_format` is checked against them as it loads)
_PART = "\n\n"  # between a harmony reply's messages of one kind
OPEN, CLOSE = "<think>", "</think>"


def split(text: str, fmt: str) -> tuple[str | None, str]:
    """(the reasoning, or None where the reply has none; the answer)."""
    if fmt == "harmony":
        return _harmony_split(text)
    if fmt != "think":
        return None, text
    lead = text.lstrip()
    if not lead.startswith(OPEN):
        return None, text
    body = lead[len(OPEN):]
    end = body.find(CLOSE)
    if end < 0:  # cut off while thinking
        return body.strip(), ""
    return body[:end].strip(), body[end + len(CLOSE):].lstrip()


def _harmony_split(text: str, msgs: list[harmony.Message] | None = None) -> tuple[str | None, str]:
    """Not stripped, so a stream's split is always a prefix of the whole's (`Splitter`).
    `msgs`: the text's messages, where the caller has read them already."""
    msgs = harmony.messages(text) if msgs is None else msgs
    thought = [m.content for m in msgs if m.channel == "analysis"]
    answer = [harmony.markup(m) if m.is_call else m.content for m in msgs if m.channel != "analysis"]
    return (_PART.join(thought) if thought else None), _PART.join(answer)


def _partial_close(body: str) -> int:
    """How many trailing characters of `body` could begin `</think>`."""
    for n in range(min(len(CLOSE) - 1, len(body)), 0, -1):
        if CLOSE.startswith(body[-n:]):
            return n
    return 0


class Splitter:
    """A stream's text cut into reasoning and answer as it comes. What it has handed out
    is always a prefix of what `split` gives for the whole text, so a reply's rest is the
    whole's less what was sent (`reasoning_rest`, and the answer's through TextStream).

    Each batch costs its own length, not the text's so far: a long thought streamed a
    token at a time was split again from its start at every token (2.2 s of the gateway's
    CPU for a 125-KB thought, growing with the square of its length). `<think>` is read
    by a state machine over the new text; harmony is split again whole only where a batch
    may change its structure (a `<` in it, or a part held back), and a batch of a message
    under way is added to its side directly."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._reasoning: list[str] = []
        self._answer: list[str] = []
        self._r_len = self._a_len = 0
        self._mode = "lead" if fmt == "think" else "harmony" if fmt == "harmony" else "plain"
        self._held = ""       # think: the undecided lead, or what may be the close or trailing space
        self._r_begun = self._a_begun = False  # (think: leading space is stripped until these)
        self._text: list[str] = []    # harmony: the whole text, re-split where the structure may change
        self._side: str | None = None  # harmony: the side a `<`-free batch goes to, where that is all it can be

    @property
    def reasoning_sent(self) -> str:
        return "".join(self._reasoning)

    @property
    def answer_sent(self) -> str:
        return "".join(self._answer)

    def feed(self, text: str | None) -> tuple[str, str]:
        """(new reasoning, new answer) once `text` is added."""
        if not text:
            return "", ""
        r: list[str] = []
        a: list[str] = []
        if self._mode == "harmony":
            self._harmony(text, r, a)
        else:
            self._think(text, r, a)
        new_r, new_a = "".join(r), "".join(a)
        if new_r:
            self._reasoning.append(new_r)
            self._r_len += len(new_r)
        if new_a:
            self._answer.append(new_a)
            self._a_len += len(new_a)
        return new_r, new_a

    def _think(self, text: str, r: list[str], a: list[str]) -> None:
        if self._mode == "lead":
            self._held += text
            lead = self._held.lstrip()
            if len(lead) < len(OPEN) and OPEN.startswith(lead):
                return  # may yet open a thought
            if not lead.startswith(OPEN):
                self._mode, text, self._held = "plain", self._held, ""
            else:
                self._mode, text, self._held = "thinking", lead[len(OPEN):], ""
        if self._mode == "thinking":
            pending = self._held + text
            end = pending.find(CLOSE)
            if end < 0:
                body = pending[:len(pending) - _partial_close(pending)]
                said = body.rstrip()  # (trailing space waits: the whole's reasoning is stripped)
                self._held = pending[len(said):]
                self._thought(said, r)
                return
            self._thought(pending[:end].rstrip(), r)
            self._mode, text, self._held = "answer", pending[end + len(CLOSE):], ""
        if self._mode == "answer" and not self._a_begun:
            text = text.lstrip()
            self._a_begun = bool(text)
        if text:
            a.append(text)

    def _thought(self, said: str, r: list[str]) -> None:
        if not self._r_begun:
            said = said.lstrip()
            self._r_begun = bool(said)
        if said:
            r.append(said)

    def _harmony(self, text: str, r: list[str], a: list[str]) -> None:
        self._text.append(text)
        if self._side is not None and "<" not in text:
            (r if self._side == "reasoning" else a).append(text)
            return
        whole = "".join(self._text)
        self._text = [whole]
        safe = harmony.safe_prefix(whole)
        msgs = harmony.messages(safe)
        reasoning, answer = _harmony_split(safe, msgs)
        r.append((reasoning or "")[self._r_len:])
        a.append(answer[self._a_len:])
        self._side = None
        if safe == whole and whole:
            if not harmony.marked_up(whole):
                self._side = "answer"
            elif msgs and not msgs[-1].ended and msgs[-1].channel:
                self._side = "reasoning" if msgs[-1].channel == "analysis" else "answer"

    def reasoning_rest(self, final: str | None) -> str:
        """What of the final reasoning was not sent yet."""
        sent = self.reasoning_sent
        if not final or not final.startswith(sent):
            return ""
        return final[len(sent):]
