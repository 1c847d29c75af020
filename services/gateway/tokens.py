"""Real token ids: a model's own chat template and tokenizer, encoded incrementally.

Where the deployment names a model's folder (`TALARIA_GATEWAY_TOKENIZERS`), the
gateway renders a conversation with that model's chat template (the
`chat_template` of its tokenizer, with the request's tools, exactly as vLLM's
OpenAI server renders it) and sends the engine token ids, so what placement,
reservations and session-prefill reckon by is what the engine's prefix cache
holds. Elsewhere (the catalog's models on the sim engine, whose tokenizers are
not at hand) the gateway keeps its stand-in ids (`services/gateway/prefix.py`).

Encoding only what changed. Re-tokenizing a 100k-token conversation per call
would cost tens of milliseconds; an agent's next turn re-sends the same text
with a few messages appended. A fast tokenizer first splits its input at its
added tokens (a chat template's role markers, `<|im_start|>` and the like) and
encodes each piece on its own, so the ids of the text before an added token
never depend on what follows it. `IncrementalEncoder` keeps each replica's
recent texts with their ids and the added tokens' places, finds how far a new
text equals a kept one, and encodes only from the last added token wholly
inside that common part. Rendering stays whole (the template is arbitrary
Jinja; its cost is stated in docs/front-door.md).
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.gateway.prefix import equal_units
from services.gateway.translate import ANTHROPIC_EFFORTS, effort_template_kwargs

ENTRIES_PER_KEY = 4        # kept texts sharing one opening (sessions with one system prompt)
KEY_CHARS = 256            # the opening a kept text is found by


class TokenizerError(ValueError):
    """A tokenizer folder the gateway cannot use (named in the message)."""


def parse_model_map(spec: str, setting: str, formats: Sequence[str] | None = None) -> dict[str, str]:
    """`model=VALUE,model2=VALUE` (`*` for every model without an entry of its own); with
    `formats`, each value one of them."""
    out: dict[str, str] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        model, sep, value = item.partition("=")
        if not sep or not model.strip() or not value.strip():
            raise TokenizerError(f"{setting}: {item!r} is not model=value (use * for every model)")
        if formats is not None and value.strip() not in formats:
            raise TokenizerError(f"{setting}: {model.strip()}={value.strip()}: not a format ({', '.join(formats)})")
        out[model.strip()] = value.strip()
    return out


def for_model(mapping: Mapping[str, str], model: str) -> str | None:
    return mapping.get(model, mapping.get("*"))


@dataclass
class _Kept:
    text: str
    ids: array           # token ids ("I")
    ends: array          # each token's end, in characters of `text` ("L")
    boundaries: list[int]  # indices of the added tokens in `ids`, ascending


class IncrementalEncoder:
    """`encode(scope, text)` equals encoding `text` whole, but encodes only from the last
    added token before the first character where `text` differs from the closest kept
    text of its scope (tenant and model). Bounded by the characters it keeps, least
    recently used out; thread-safe (the gateway encodes off its event loop)."""

    def __init__(self, encode: Callable[[str], tuple[list[int], list[tuple[int, int]]]], added_ids: frozenset[int],
                 max_chars: int = 32 << 20) -> None:
        self._encode = encode          # text -> (ids, (start, end) character offsets), no special tokens added
        self.added_ids = added_ids
        self.max_chars = max_chars
        self._chars = 0
        self._kept: OrderedDict[str, list[_Kept]] = OrderedDict()
        self._lock = threading.Lock()
        self.encoded_chars = 0         # characters actually encoded (what the cache saved shows against the texts' sizes)

    def encode(self, scope: str, text: str) -> array:
        key = scope + "\0" + text[:KEY_CHARS]
        with self._lock:
            kept = list(self._kept.get(key, ()))
        best, cut, start, extended = None, 0, 0, None
        for k in kept:
            at, tok, whole = self._restart(k, text)
            if at > cut:
                best, cut, start = k, at, tok
            if whole:
                extended = k  # this text continues that one: it takes its place
        ids, ends = array("I"), array("L")
        boundaries: list[int] = []
        if best is not None:
            ids, ends = best.ids[:start], best.ends[:start]
            boundaries = best.boundaries[:bisect.bisect_left(best.boundaries, start)]
        new_ids, offsets = self._encode(text[cut:])
        self.encoded_chars += len(text) - cut
        base = len(ids)
        ids.extend(new_ids)
        ends.extend(cut + e for _, e in offsets)
        boundaries += [base + i for i, t in enumerate(new_ids) if t in self.added_ids]
        self._keep(key, _Kept(text, ids, ends, boundaries), replaced=extended)
        return array("I", ids)

    @staticmethod
    def _restart(k: _Kept, text: str) -> tuple[int, int, bool]:
        """(character, token index) to encode from: the start of the last added token that
        lies wholly inside the common prefix of `k.text` and `text`, (0, 0) if none; and
        whether `text` begins with all of `k.text` (the same conversation, continued)."""
        same = equal_units(k.text, text)  # (characters)
        whole = same == len(k.text)
        if whole and same == len(text):
            return same, len(k.ids), True
        lo, hi = 0, len(k.boundaries)
        while lo < hi:  # first boundary whose end is past `same`
            mid = (lo + hi) // 2
            if k.ends[k.boundaries[mid]] <= same:
                lo = mid + 1
            else:
                hi = mid
        i = lo - 1
        if i < 0:
            return 0, 0, whole
        tok = k.boundaries[i]
        start = k.ends[tok - 1] if tok > 0 else 0
        return int(start), tok, whole

    def _keep(self, key: str, entry: _Kept, replaced: _Kept | None) -> None:
        if len(entry.text) > self.max_chars:
            return
        with self._lock:
            lst = self._kept.pop(key, [])
            if replaced is not None and replaced in lst:
                lst.remove(replaced)
                self._chars -= len(replaced.text)
            lst.insert(0, entry)
            self._chars += len(entry.text)
            while len(lst) > ENTRIES_PER_KEY:
                self._chars -= len(lst.pop().text)
            self._kept[key] = lst
            while self._chars > self.max_chars and self._kept:
                _, gone = self._kept.popitem(last=False)
                self._chars -= sum(len(g.text) for g in gone)


class ChatTokenizer:
    """A model folder's tokenizer and chat template (Hugging Face `tokenizer.json` and
    `tokenizer_config.json`; transformers renders the template as vLLM does)."""

    def __init__(self, folder: str | Path, max_chars: int = 32 << 20) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # an optional dependency: only a deployment that names tokenizers needs it
            raise TokenizerError(f"TALARIA_GATEWAY_TOKENIZERS needs the transformers package ({exc})") from None
        path = Path(folder)
        if not (path / "tokenizer_config.json").is_file():
            raise TokenizerError(f"{folder}: no tokenizer_config.json (not a model or tokenizer folder)")
        try:
            self.hf = AutoTokenizer.from_pretrained(str(path), use_fast=True)
        except Exception as exc:  # noqa: BLE001 - named for the operator, whatever transformers raised
            raise TokenizerError(f"{folder}: the tokenizer does not load: {type(exc).__name__}: {exc}") from None
        if not getattr(self.hf, "is_fast", False):
            raise TokenizerError(f"{folder}: no fast tokenizer (tokenizer.json) to encode incrementally")
        if not self.hf.chat_template:
            raise TokenizerError(f"{folder}: the tokenizer has no chat template")
        self.folder = str(path)
        backend = self.hf.backend_tokenizer
        added = frozenset(int(i) for i in self.hf.added_tokens_decoder)

        def encode(text: str) -> tuple[list[int], list[tuple[int, int]]]:
            enc = backend.encode(text, add_special_tokens=False)
            return enc.ids, enc.offsets

        self.encoder = IncrementalEncoder(encode, added, max_chars)
        self._disabled_effort: str | None = None

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
               continue_final: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The conversation as the model sees it, ending in the assistant's turn: a new one,
        or (`continue_final`) the last message's own, left open for the model to go on;
        `template_kwargs` are the template's own variables (Qwen3's `enable_thinking`)."""
        return str(self.hf.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=False,
                                               add_generation_prompt=not continue_final,
                                               continue_final_message=continue_final, **(template_kwargs or {})))

    def disabled_thinking_effort(self) -> str:
        """The effort that turns thinking off for Messages' `thinking: disabled`, found as
        vLLM's Anthropic front end finds it: `none`, unless the template refuses it or
        renders it as it renders an effort (a template that reads an effort it does not
        know as its most), then `low`."""
        if self._disabled_effort is None:
            probe = [{"role": "user", "content": "Hi"}]

            def rendered(effort: str) -> str | None:
                try:
                    return self.render(probe, None, template_kwargs=effort_template_kwargs(effort, {}))
                except Exception:  # noqa: BLE001 - the template's refusal of that effort
                    return None

            off = rendered("none")
            self._disabled_effort = "low" if off is None or any(rendered(e) == off for e in ANTHROPIC_EFFORTS) \
                else "none"
        return self._disabled_effort

    def encode(self, scope: str, text: str) -> array:
        return self.encoder.encode(scope, text)

    def encode_whole(self, text: str) -> list[int]:
        """Every id of `text`, encoded from scratch (what the incremental encoder must equal)."""
        return list(self.hf.backend_tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=False))


class Tokenizers:
    """Each served model's chat tokenizer, loaded once per folder on first use; a model
    without one (None) keeps the stand-in ids."""

    def __init__(self, spec: str) -> None:
        self.folders = parse_model_map(spec, "TALARIA_GATEWAY_TOKENIZERS")
        self._loaded: dict[str, ChatTokenizer] = {}

    def load_all(self) -> None:
        for folder in set(self.folders.values()):
            if folder not in self._loaded:
                self._loaded[folder] = ChatTokenizer(folder)

    def get(self, model: str) -> ChatTokenizer | None:
        folder = for_model(self.folders, model)
        if folder is None:
            return None
        tok = self._loaded.get(folder)
        if tok is None:
            tok = self._loaded[folder] = ChatTokenizer(folder)
        return tok
