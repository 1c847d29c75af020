"""Prefix identity by token blocks (pure; no I/O).

What a session's engine can reuse on its next call is the longest common prefix of
the token ids it received last time plus what it returned, and the ids it receives
now. Comparing ids would cost the whole history per call; instead, as vLLM's
prefix cache and llm-d's precise prefix scorer do, the ids are cut into blocks of
`BLOCK_TOKENS` and each full block is named by a hash chained to the one before
it, so one equal hash at block k means the first k+1 blocks are equal. A
session's chain is 8 bytes a block: 50 KB for a 100k-token session.

Token ids. The gateway does not yet run the models' own tokenizers (the catalog's
models are not on this machine): `conversation_ids` renders a conversation into
stand-in ids, four per message for its role framing (as a chat template adds
them) and one per four UTF-8 bytes of its text, the counts the gateway has
always estimated. Each message's ids depend on that message alone, so a history
re-sent verbatim gives the same ids, and one re-serialised differently (a tool
call's JSON in another order, a thinking block stripped) diverges exactly there.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BLOCK_TOKENS = 16        # tokens a block (vLLM's default KV block size)
HASH_BYTES = 8           # bytes of each block's chained hash
BYTES_PER_TOKEN = 4      # the stand-in tokenizer: one id per four UTF-8 bytes
ID_BYTES = 4             # bytes of one id in an array("I")
MESSAGE_FRAME_TOKENS = 4  # a message's role and separators, as chat templates add them
# framing ids lie above any four bytes of UTF-8 (which never holds 0xFF), so text never forges them
_FRAME_BASE = 0xFFFFFF00
_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "text", "tools")
CHAIN_ROOT = b"talaria-prefix-v1"  # the parent of a chain's first block


def text_ids(text: str) -> array:
    """The stand-in ids of a text: its UTF-8 bytes four at a time (the last padded), at least one."""
    data = text.encode("utf-8", "surrogatepass")
    if not data:
        return array("I", [0])
    data += b"\0" * (-len(data) % BYTES_PER_TOKEN)
    ids = array("I")
    ids.frombytes(data)
    return ids


def frame_ids(role: str) -> array:
    r = _ROLES.index(role) if role in _ROLES else len(_ROLES)
    return array("I", [_FRAME_BASE + r, _FRAME_BASE + 0x80, _FRAME_BASE + 0x81, _FRAME_BASE + 0x82])


def message_ids(role: str, text: str) -> array:
    return frame_ids(role) + text_ids(text)


def conversation_ids(messages: Sequence[tuple[str, str]]) -> array:
    """A conversation's stand-in ids, message after message ((role, text) each)."""
    out = array("I")
    for role, text in messages:
        out += message_ids(role, text)
    return out


def block_hashes(ids: array, parent: bytes = CHAIN_ROOT) -> list[bytes]:
    """The chained hash of each full block of `ids` (a partial last block has none:
    the engine cannot reuse a block it has not filled either)."""
    return _hash_blocks(ids.tobytes(), 0, parent)


def _hash_blocks(data: bytes, start: int, parent: bytes) -> list[bytes]:
    """The chain of `data`'s full blocks from byte `start` on, the first chained to `parent`."""
    view = memoryview(data)
    step = BLOCK_TOKENS * ID_BYTES
    out = []
    h = parent[:HASH_BYTES]
    blake2b = hashlib.blake2b
    for at in range(start, len(view) - step + 1, step):
        h = blake2b(h + view[at:at + step], digest_size=HASH_BYTES).digest()
        out.append(h)
    return out


class ChainCache:
    """The chains of recent prompts, so a call hashes only the blocks its conversation
    appended since the last one (a 100k-token prompt re-hashed whole costs about 2.5 ms
    here). Keyed by the scope (tenant and model) and the prompt's first block, and always
    right: a cached chain is reused only for the leading blocks whose bytes are equal,
    found by comparing the ids themselves (memcmp, not hashing). A miss (another gateway
    replica served the last call, or it was evicted) hashes the whole prompt. Bounded
    by the memory its entries take (the ids, the key and the chain's hash objects, with
    their headers), least recently used first out: counting the ids alone let a cache of
    short prompts hold 2.5x its bound."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[bytes, tuple[bytes, list[bytes], int]] = OrderedDict()

    def chain(self, scope: str, ids: array) -> list[bytes]:
        """`block_hashes(ids)`, from the cached chain of the longest equal prefix."""
        data = ids.tobytes()
        step = BLOCK_TOKENS * ID_BYTES
        key = scope.encode() + b"\0" + data[:step]
        hit = self._entries.get(key)
        if hit is None:
            chain = _hash_blocks(data, 0, CHAIN_ROOT)
        else:
            old, old_chain, _ = hit
            k = equal_units(old, data, step, len(old_chain))
            chain = old_chain[:k] + _hash_blocks(data, k * step, old_chain[k - 1] if k else CHAIN_ROOT)
        self._put(key, data, chain)
        return chain

    def _put(self, key: bytes, data: bytes, chain: list[bytes]) -> None:
        size = _entry_bytes(key, data, chain)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[2]
        self._entries[key] = (data, chain, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, _, gone) = self._entries.popitem(last=False)
            self._bytes -= gone


_BYTES_HEADER = sys.getsizeof(b"")  # a bytes object's header (33 on CPython 3.11, 64-bit)
# a hash: its bytes object and its slot in the chain's list
_HASH_ENTRY_BYTES = _BYTES_HEADER + HASH_BYTES + 8
# an entry's fixed part: the dict's slot and node, its tuple, the chain's list, the two bytes headers
_ENTRY_FIXED_BYTES = 100 + sys.getsizeof((0, 0, 0)) + sys.getsizeof([]) + 2 * _BYTES_HEADER


def _entry_bytes(key: bytes, data: bytes, chain: list[bytes]) -> int:
    """About the memory one `ChainCache` entry takes."""
    return _ENTRY_FIXED_BYTES + len(key) + len(data) + len(chain) * _HASH_ENTRY_BYTES


def equal_units(a: Sequence[Any], b: Sequence[Any], step: int = 1, most: int | None = None) -> int:
    """How many leading units of `step` elements `a` and `b` share (at most `most`): bytes
    in blocks, or a string's characters. A binary search over equal slices, each one memcmp."""
    most = len(a) + len(b) if most is None else most
    hi = min(most, len(a) // step, len(b) // step)
    if a[:hi * step] == b[:hi * step]:
        return hi
    lo = 0  # a[:lo*step] == b[:lo*step] holds; a[:hi*step] != b[:hi*step]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid * step] == b[:mid * step]:
            lo = mid
        else:
            hi = mid
    return lo


def common_blocks(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading blocks two chains share (chained: the first difference ends it).
    Binary search: equal at block k means equal up to k."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def pack(chain: Sequence[bytes]) -> bytes:
    return b"".join(chain)


def unpack(data: bytes | None) -> list[bytes]:
    if not data:
        return []
    return [data[i:i + HASH_BYTES] for i in range(0, len(data) - HASH_BYTES + 1, HASH_BYTES)]


# -- a named session's branches ----------------------------------------------------------------------
# A session named by its header may send calls that are not its conversation continued: OpenCode
# asks for the session's title under the same header, with its own short prompt. The engine's
# prefix cache still holds the conversation after such a call, so the session keeps the chains
# of its last few branches, and a call holds what the branch it extends holds.
BRANCHES_KEPT = 4
_COUNT_BYTES = 4  # each branch is its block count, then its hashes


def with_branch(branches: Sequence[Sequence[bytes]], chain: Sequence[bytes]) -> list[Sequence[bytes]]:
    """A session's branches once a call left `chain`: it first, then the earlier branches it
    does not extend, newest first, at most BRANCHES_KEPT and, in all, at most twice the
    longest one's blocks (a session whose history is compacted again and again would
    otherwise keep several long chains where it kept one)."""
    candidates = ([chain] if chain else []) + [b for b in branches if common_blocks(b, chain) < len(b)]
    budget = 2 * max((len(b) for b in candidates), default=0)
    kept: list[Sequence[bytes]] = []
    for b in candidates[:BRANCHES_KEPT]:
        if len(b) <= budget:
            kept.append(b)
            budget -= len(b)
    return kept


def held_blocks(branches: Sequence[Sequence[bytes]], chain: Sequence[bytes]) -> int:
    """How many leading blocks of `chain` the session holds: the most any branch shares."""
    return max((common_blocks(b, chain) for b in branches), default=0)


def pack_branches(branches: Sequence[Sequence[bytes]]) -> bytes:
    return b"".join(len(b).to_bytes(_COUNT_BYTES, "big") + pack(b) for b in branches)


def unpack_branches(data: bytes | None) -> list[list[bytes]]:
    """The branches `pack_branches` wrote; what is cut short or malformed ends them."""
    out: list[list[bytes]] = []
    at = 0
    while data and at + _COUNT_BYTES <= len(data):
        n = int.from_bytes(data[at:at + _COUNT_BYTES], "big")
        end = at + _COUNT_BYTES + n * HASH_BYTES
        if n == 0 or end > len(data):
            break
        out.append(unpack(data[at + _COUNT_BYTES:end]))
        at = end
    return out


# -- sessions without a header ----------------------------------------------------------------------
@dataclass(frozen=True)
class OpenChain:
    """A header-less session's chain as last left: its length in blocks and its last block's hash."""

    session_id: str
    blocks: int
    tail: bytes
    updated_at: float  # wall seconds

    def encode(self) -> str:
        return f"{self.blocks}:{self.tail.hex()}:{self.updated_at:.3f}"

    @classmethod
    def decode(cls, session_id: str, value: str) -> OpenChain | None:
        try:
            blocks, tail, at = value.split(":")
            return cls(session_id, int(blocks), bytes.fromhex(tail), float(at))
        except ValueError:
            return None


def extended_by(chain: Sequence[bytes], open_chains: Sequence[OpenChain], now: float, idle_s: float) -> list[OpenChain]:
    """The open sessions whose chain `chain` extends (its block at their length has their
    tail's hash), longest first: the one to join is the first that has no call in
    flight; none (or all busy) means a new session. Two runs of one task start alike,
    and the second, finding the first busy, forks. Sessions idle past `idle_s` are
    released by the router and not joined."""
    out = [o for o in open_chains
           if 0 < o.blocks <= len(chain) and chain[o.blocks - 1] == o.tail and now - o.updated_at <= idle_s]
    out.sort(key=lambda o: (-o.blocks, -o.updated_at, o.session_id))
    return out
