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

FORMATS = ("think", "harmony", "none")
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


def _harmony_split(text: str) -> tuple[str | None, str]:
    """Not stripped, so a stream's split is always a prefix of the whole's (`Splitter`)."""
    msgs = harmony.messages(text)
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
    whole's less what was sent (`reasoning_rest`, and the answer's through TextStream)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.text = ""
        self.reasoning_sent = ""
        self.answer_sent = ""

    def feed(self, text: str | None) -> tuple[str, str]:
        """(new reasoning, new answer) once `text` is added."""
        if not text:
            return "", ""
        self.text += text
        reasoning, answer = self._safe()
        new_r = reasoning[len(self.reasoning_sent):]
        new_a = answer[len(self.answer_sent):]
        self.reasoning_sent, self.answer_sent = reasoning, answer
        return new_r, new_a

    def _safe(self) -> tuple[str, str]:
        """What of the text so far is surely reasoning and surely answer."""
        if self.fmt == "harmony":
            reasoning, answer = _harmony_split(harmony.safe_prefix(self.text))
            return reasoning or "", answer
        if self.fmt != "think":
            return "", self.text
        lead = self.text.lstrip()
        if len(lead) < len(OPEN) and OPEN.startswith(lead):
            return "", ""  # may yet open a thought
        if not lead.startswith(OPEN):
            return "", self.text
        body = lead[len(OPEN):]
        end = body.find(CLOSE)
        if end >= 0:
            return body[:end].strip(), body[end + len(CLOSE):].lstrip()
        held = body[:len(body) - _partial_close(body)]
        return held.strip(), ""  # (trailing space waits: the whole's reasoning is stripped)

    def reasoning_rest(self, final: str | None) -> str:
        """What of the final reasoning was not sent yet."""
        if not final or not final.startswith(self.reasoning_sent):
            return ""
        return final[len(self.reasoning_sent):]
