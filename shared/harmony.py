"""gpt-oss's harmony format, read from the model's text (pure; no I/O).

gpt-oss writes every reply as messages, each on a channel: `analysis` (its reasoning),
`commentary` (a tool call, addressed `to=functions.<name>`, or a preamble the user may
see) and `final` (the answer). A reply begins after the prompt's `<|start|>assistant`:

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The recipient may stand before the channel as well (`<|start|>assistant to=functions.x<|channel|>
commentary json<|message|>`). A message ends at `<|end|>`, `<|return|>` (the reply's end) or
`<|call|>` (a tool call's end); one cut off by the token bound ends with the text. vLLM reads
the same from token ids (openai-harmony: `--reasoning-parser openai_gptoss`,
`--tool-call-parser openai`); here the engine's text keeps the special tokens (the vLLM
engine asks for them for this format). A reply's last message may lack its end marker
where the engine leaves out the token it stopped on (`<|call|>`, `<|return|>`). Text
without harmony's markup is one message on no channel: the sim engine's filler, or a
server that stripped the markup.

- `messages`: a text's messages, the last one possibly unfinished.
- `safe_prefix`: a streamed text less a marker it may end halfway through.
- `markup`, `call_markup`: a tool call as the model writes it (a call kept in an answer
  for the tool-call parser; the sim engine's synthetic calls).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_ENDS = (END, RETURN, CALL, START)  # (a `<|start|>` with no end before it: the model began another message)
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_HEADER = re.compile(r"\s*(?:<\|start\|>|<\|channel\|>)")
_FIRST_HEADER = re.compile(r"\s*(?:<\|start\|>|<\|channel\|>|to=)")  # (the reply's first may open with its recipient)
FUNCTIONS = "functions."  # the namespace of the request's tools (the developer message's `namespace functions`)


@dataclass(frozen=True)
class Message:
    channel: str    # analysis, commentary, final; "" where the text has no markup
    recipient: str  # a tool call's (`functions.<name>`), else ""
    content: str
    ended: bool     # by its end marker (False: cut off, or still coming)

    @property
    def is_call(self) -> bool:
        return bool(self.recipient)


def marked_up(text: str) -> bool:
    return MESSAGE in text or CHANNEL in text or START in text


def messages(text: str) -> list[Message]:
    """The messages of a reply; text before the first header and text with no markup at
    all are messages on no channel. A header whose `<|message|>` has not come yet is left out."""
    if not marked_up(text):
        return [Message("", "", text, True)] if text else []
    out: list[Message] = []
    i = 0
    while i < len(text):
        if not (_FIRST_HEADER if i == 0 else _HEADER).match(text, i):
            j = min((k for k in (text.find(START, i), text.find(CHANNEL, i)) if k >= 0), default=len(text))
            if text[i:j].strip():
                out.append(Message("", "", text[i:j], True))
            i = j
            continue
        body = text.find(MESSAGE, i)
        if body < 0:
            break  # a header still coming
        header = text[i:body]
        start = body + len(MESSAGE)
        end, marker = min(((k, m) for m in _ENDS if (k := text.find(m, start)) >= 0), default=(len(text), ""))
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        out.append(Message(channel.group(1) if channel else "", recipient.group(1) if recipient else "",
                           text[start:end], marker != ""))
        i = end + (len(marker) if marker != START else 0)
    return out


def safe_prefix(text: str) -> str:
    """`text` less a trailing part that may yet become a marker (`<|en`), or all of it while
    it may yet be a first header (blank, or `to=...` before any marker): what a stream can
    read now without a marker's first characters showing as content."""
    cut = text.rfind("<")
    if cut >= 0 and any(m.startswith(text[cut:]) and m != text[cut:] for m in MARKERS):
        text = text[:cut]
    lead = text.lstrip()
    if not marked_up(text) and (not lead or "to=".startswith(lead) or lead.startswith("to=")):
        return ""
    return text


def tool_name(recipient: str) -> str:
    return recipient.removeprefix(FUNCTIONS)


def markup(m: Message) -> str:
    """A message addressed to a tool as gpt-oss writes it (a call left in the text)."""
    return (f"{START}assistant{CHANNEL}{m.channel or 'commentary'} to={m.recipient} {CONSTRAIN}json{MESSAGE}{m.content}"
            + (CALL if m.ended else ""))


def call_markup(name: str, arguments: str) -> str:
    """A call of the request's tool `name` with `arguments` (JSON), as gpt-oss writes one."""
    return markup(Message("commentary", FUNCTIONS + name, arguments, True))
