"""The KV locality index kept from a real engine's KV-cache events.

vLLM publishes `BlockStored`, `BlockRemoved` and `AllBlocksCleared` (ZMQ,
`kv_events_config`); the engine-worker decodes them with vLLM's own
`KVEventBatch`, turns them into our msgspec events (`shared.schema.KvEvent`),
republishes them on NATS and applies them here, so Redis says which server
holds which session's prefix because the engine said so:

- `kv_blocks(server, model)`: hash block hash -> session id;
- `kv_session_blocks(session, server)`: set of the session's block hashes there;
- `kv_locality(session)`: hash server -> "hbm" while that set is not empty
  (what the router's placement reads).

The engine does not know sessions; `BlockMatcher` maps a stored block to the
session whose recent prompt (plus output) holds its tokens, following
`parent_block_hash` chains.
"""

from __future__ import annotations

from collections import OrderedDict

import redis.asyncio as aioredis

from shared import state
from shared.keys import SESSION_TTL_S, Keys
from shared.schema import KvAllCleared, KvBlocksRemoved, KvBlocksStored, KvEvent


def hash_str(h: object) -> str:
    """vLLM block hashes are ints (or bytes in some versions): one string form for keys."""
    if isinstance(h, (bytes, bytearray)):
        return bytes(h).hex()
    return str(h)


class BlockMatcher:
    """Which session a stored block belongs to: the block's depth in its chain
    (parent's depth + 1, 0 for a root) says where its tokens sit in a sequence;
    the session whose recent token sequence has those tokens there owns it."""

    def __init__(self, keep: int = 256) -> None:
        self.seqs: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()  # request id -> (session, tokens)
        self.depth: dict[str, tuple[str | None, int]] = {}                 # block hash -> (session, depth)
        self.keep = keep

    def track(self, request_id: str, session_id: str, token_ids: list[int]) -> None:
        self.seqs[request_id] = (session_id, token_ids)
        self.seqs.move_to_end(request_id)
        while len(self.seqs) > self.keep:
            self.seqs.popitem(last=False)

    def extend(self, request_id: str, more: list[int]) -> None:
        if request_id in self.seqs:
            sid, seq = self.seqs[request_id]
            self.seqs[request_id] = (sid, seq + list(more))

    def stored(self, hashes: list[str], parent: str | None, token_ids: list[int], block_size: int) -> str | None:
        start_depth = 0
        owner: str | None = None
        if parent is not None and parent in self.depth:
            owner, d = self.depth[parent]
            start_depth = d + 1
        if owner is None and block_size > 0:
            lo = start_depth * block_size
            for sid, seq in reversed(self.seqs.values()):  # newest first
                if seq[lo:lo + len(token_ids)] == list(token_ids):
                    owner = sid
                    break
        for i, h in enumerate(hashes):
            self.depth[h] = (owner, start_depth + i)
        return owner

    def removed(self, hashes: list[str]) -> None:
        for h in hashes:
            self.depth.pop(h, None)

    def cleared(self) -> None:
        self.depth.clear()


class KvIndex:
    """Applies KV events to Redis (one server's engine for one model)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, server_id: str, model: str) -> None:
        self.redis = redis
        self.keys = keys
        self.server_id = server_id
        self.model = model

    async def apply(self, ev: KvEvent) -> None:
        k, sid_server = self.keys, self.server_id
        blocks = k.kv_blocks(sid_server, self.model)
        match ev:
            case KvBlocksStored(session_id=session, block_hashes=hashes, medium=medium):
                if session is None or not hashes:
                    return
                if medium is not None and medium.upper() == "CPU":
                    # vLLM's CPU offload tier (GPU deployments): restorable from host,
                    # unless the session also holds blocks in HBM here
                    current = await self.redis.hget(k.kv_locality(session), sid_server)
                    if current != b"hbm":
                        pipe = self.redis.pipeline(transaction=True)
                        state.note_kv_locality(pipe, k, session, sid_server, "host")
                        await pipe.execute()
                    return
                pipe = self.redis.pipeline(transaction=True)
                pipe.hset(blocks, mapping={h: session for h in hashes})
                pipe.sadd(k.kv_session_blocks(session, sid_server), *hashes)
                pipe.expire(k.kv_session_blocks(session, sid_server), SESSION_TTL_S)
                state.note_kv_locality(pipe, k, session, sid_server, "hbm")
                await pipe.execute()
            case KvBlocksRemoved(block_hashes=hashes):
                if not hashes:
                    return
                owners = await self.redis.hmget(blocks, hashes)
                by_session: dict[str, list[str]] = {}
                for h, o in zip(hashes, owners):
                    if o is not None:
                        by_session.setdefault(o.decode(), []).append(h)
                pipe = self.redis.pipeline(transaction=True)
                pipe.hdel(blocks, *hashes)
                for session, hs in by_session.items():
                    pipe.srem(k.kv_session_blocks(session, sid_server), *hs)
                await pipe.execute()
                for session in by_session:
                    if await self.redis.scard(k.kv_session_blocks(session, sid_server)) == 0:
                        await self.redis.hdel(k.kv_locality(session), sid_server)
            case KvAllCleared():
                owners = await self.redis.hvals(blocks)
                sessions = {o.decode() for o in owners}
                pipe = self.redis.pipeline(transaction=True)
                pipe.delete(blocks)
                for session in sessions:
                    pipe.delete(k.kv_session_blocks(session, sid_server))
                    pipe.hdel(k.kv_locality(session), sid_server)
                await pipe.execute()

    async def sessions_held(self) -> dict[str, int]:
        """Session -> number of its blocks this engine holds (from the index)."""
        out: dict[str, int] = {}
        for o in await self.redis.hvals(self.keys.kv_blocks(self.server_id, self.model)):
            out[o.decode()] = out.get(o.decode(), 0) + 1
        return out

    async def demote_to_host(self) -> list[str]:
        """The engine slept (its HBM KV is gone) with a host KV tier outside the
        process holding what it wrote: every session this engine held is now
        restorable from host memory on this server, not in HBM."""
        k, sid_server = self.keys, self.server_id
        blocks = k.kv_blocks(sid_server, self.model)
        sessions = sorted({o.decode() for o in await self.redis.hvals(blocks)})
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(blocks)
        for session in sessions:
            pipe.delete(k.kv_session_blocks(session, sid_server))
            state.note_kv_locality(pipe, k, session, sid_server, "host")
        await pipe.execute()
        return sessions
