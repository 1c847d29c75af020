"""The transport floor under a call: the control plane's hops with no logic behind them.

`talaria bench-control-plane --floor` runs this beside the stack's rows. Bare
processes stand where the router, admission and the engine-worker stand, on a NATS
server with JetStream and a Redis of their own, and pass a call along the path a
call takes through the services (docs/results.md lists it): every message the
agent, the router, admission and the engine publish, the call record's JetStream
writes (create, the router's `placed`, the engine's claim and its answer), and
nine Redis round trips of about the commands the stack sends a call. They decide
nothing, log nothing and keep no state; each payload is a small msgspec map. What
the processes, NATS and Redis spend a call here is what the promises cost in hops
on this machine before any of Talaria's own work: the stack's figure minus this
one is ours. Three layouts (`LAYOUTS`): today's three processes; admission and
the engine in one process per server (no run, running, acknowledgement or
finished on the bus); all three roles in one (no `placed` write, claim or submit
either: the record's create names the server that holds the call).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid

import msgspec

BUCKET = "floor_calls"
LAYOUTS = {"3 procs": ("router", "admission", "engine"),  # today's path
           "2 procs": ("router", "node"),  # admission and the engine in one process per server
           "1 proc": ("single",)}  # the three roles in one process, the same promises
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def _payload(call_id: str, what: str) -> bytes:
    # about the size of a small call's event (ids, a model, a few numbers)
    return _encode({"call_id": call_id, "session_id": call_id[:12], "model": "glm-4.5-air-fp8", "what": what,
                    "prompt_tokens": 64, "max_tokens": 1, "server": "s0", "at": time.time(), "epoch": 1})


async def serve(role: str, nats_url: str, redis_url: str, prefix: str) -> None:
    """One bare hop: the role's messages, record writes and Redis round trips for each call it sees."""
    import nats
    import redis.asyncio as aioredis

    from shared.bus import REDIS_POOL_CONNECTIONS, REDIS_POOL_WAIT_S

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    kv = await js.key_value(BUCKET)
    # the services' bounded pool that waits (shared/bus.py): calls in flight side by side
    r = aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
        redis_url, max_connections=REDIS_POOL_CONNECTIONS, timeout=REDIS_POOL_WAIT_S))
    tasks: set[asyncio.Task[None]] = set()
    errors: dict[str, int] = {}

    def done(t: asyncio.Task[None]) -> None:
        tasks.discard(t)
        if not t.cancelled() and (exc := t.exception()) is not None:  # counted; the agent counts the call failed
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

    def spawn(coro) -> None:  # type: ignore[no-untyped-def]
        t = asyncio.ensure_future(coro)
        tasks.add(t)
        t.add_done_callback(done)

    # -- the Redis round trips, as the services make them (about their commands) --------------
    async def read_session(cid: str) -> None:  # the session's gaps, outputs and reservation
        async with r.pipeline(transaction=False) as p:
            p.rpush(f"g:{cid[:12]}", "1.0").lrange(f"g:{cid[:12]}", -8, -1).lrange(f"o:{cid[:12]}", -8, -1)
            p.get(f"res:{cid[:12]}").expire(f"g:{cid[:12]}", 600)
            await p.execute()

    async def read_snapshot() -> None:  # the servers' snapshot
        await r.hmget("srv:s0", ["load", "free", "active", "queued"])

    async def place(cid: str) -> None:  # the placement's compare-and-set and its in-flight entry
        async with r.pipeline(transaction=False) as p:
            p.hincrby("srv:s0", "placed", 1).hset("inflight:s0", cid, "1").expire("inflight:s0", 600)
            await p.execute()

    async def persist(cid: str, data: bytes) -> None:  # the queued call, kept for a restarted admission
        await r.hset("adm:s0", cid, data)

    async def write_locality(cid: str) -> None:  # KV locality of the prefix
        async with r.pipeline(transaction=True) as p:
            p.hset(f"kv:{cid[:12]}", "s0", "gpu").expire(f"kv:{cid[:12]}", 600).sadd(f"blocks:{cid[:12]}", "b1")
            await p.execute()

    async def write_finish(cid: str) -> None:  # the finish's counters, then the session's last finish
        async with r.pipeline(transaction=False) as p:
            p.hincrby("eng:s0", "calls", 1).hincrbyfloat("eng:s0", "busy", 0.1).set(f"last:{cid[:12]}", "1")
            await p.execute()
        async with r.pipeline(transaction=True) as p:
            p.hset(f"sess:{cid[:12]}", "last_finish", "1").expire(f"sess:{cid[:12]}", 600)
            await p.execute()

    async def unpersist_and_mirror(cid: str) -> None:  # the mirror admission keeps for placement
        await r.hdel("adm:s0", cid)
        async with r.pipeline(transaction=True) as p:
            p.hset("srv:s0", mapping={"load": 1, "free": 2}).hincrby("srv:s0", "done", 1).expire("srv:s0", 600)
            await p.execute()

    async def generate_and_answer(cid: str, claimed: int) -> None:
        await write_locality(cid)
        reply = _payload(cid, "reply")
        await kv.update(cid, reply, last=claimed)  # the answer recorded before the reply goes out
        await nc.publish(f"{prefix}.inbox.{cid}", reply)
        await write_finish(cid)

    # -- the roles ---------------------------------------------------------------------------
    async def on_call(msg) -> None:  # type: ignore[no-untyped-def]
        body = _decode(msg.data)
        cid = body["call_id"]
        rev = await kv.create(cid, msg.data)  # stored before it is acknowledged
        await read_session(cid)
        await read_snapshot()
        placed, _ = await asyncio.gather(kv.update(cid, msg.data, last=rev), place(cid))
        answer = await nc.request(f"{prefix}.submit", _encode({**body, "rev": placed}), timeout=10)
        await msg.respond(answer.data)  # the receipt

    async def on_submit(msg) -> None:  # type: ignore[no-untyped-def]
        cid = _decode(msg.data)["call_id"]
        await persist(cid, msg.data)
        await msg.respond(_payload(cid, "queued"))
        await nc.publish(f"{prefix}.run", msg.data)
        await nc.publish(f"{prefix}.inbox.{cid}", _payload(cid, "accepted"))

    async def on_engine_event(msg) -> None:  # type: ignore[no-untyped-def]
        cid = _decode(msg.data)["call_id"]
        if msg.subject.endswith(".finished"):
            await unpersist_and_mirror(cid)
            await nc.publish(f"{prefix}.protect", _payload(cid, "protect"))

    async def on_run(msg) -> None:  # type: ignore[no-untyped-def]
        body = _decode(msg.data)
        cid = body["call_id"]
        claimed = await kv.update(cid, _payload(cid, "claimed"), last=body["rev"])
        await nc.publish(f"{prefix}.engine.running", _payload(cid, "running"))
        await nc.publish(f"{prefix}.run.ack", _payload(cid, "ack"))
        await generate_and_answer(cid, claimed)
        await nc.publish(f"{prefix}.engine.finished", _payload(cid, "finished"))

    async def on_submit_node(msg) -> None:  # type: ignore[no-untyped-def]
        # admission and the engine in one process per server: no run, running, ack or finished on the bus
        body = _decode(msg.data)
        cid = body["call_id"]
        await persist(cid, msg.data)
        await msg.respond(_payload(cid, "queued"))
        await nc.publish(f"{prefix}.inbox.{cid}", _payload(cid, "accepted"))
        claimed = await kv.update(cid, _payload(cid, "claimed"), last=body["rev"])
        await generate_and_answer(cid, claimed)
        await unpersist_and_mirror(cid)
        await nc.publish(f"{prefix}.protect", _payload(cid, "protect"))

    async def on_call_single(msg) -> None:  # type: ignore[no-untyped-def]
        # the three roles in one process: the same promises and Redis round trips, no hops between them
        # (the record's create names the server that holds the call, so no `placed` write or claim)
        body = _decode(msg.data)
        cid = body["call_id"]
        rev = await kv.create(cid, msg.data)
        await read_session(cid)
        await read_snapshot()
        await place(cid)
        await persist(cid, msg.data)
        await msg.respond(_payload(cid, "queued"))
        await nc.publish(f"{prefix}.inbox.{cid}", _payload(cid, "accepted"))
        await generate_and_answer(cid, rev)
        await unpersist_and_mirror(cid)
        await nc.publish(f"{prefix}.protect", _payload(cid, "protect"))

    def handler(fn):  # type: ignore[no-untyped-def]
        async def cb(msg) -> None:  # type: ignore[no-untyped-def]
            spawn(fn(msg))  # side by side, as the services handle requests
        return cb

    if role == "single":
        await nc.subscribe(f"{prefix}.call", cb=handler(on_call_single))
    elif role == "router":
        await nc.subscribe(f"{prefix}.call", cb=handler(on_call))
    elif role == "node":
        await nc.subscribe(f"{prefix}.submit", cb=handler(on_submit_node))
    elif role == "admission":
        await nc.subscribe(f"{prefix}.submit", cb=handler(on_submit))
        await nc.subscribe(f"{prefix}.engine.*", cb=handler(on_engine_event))
        await nc.subscribe(f"{prefix}.run.ack", cb=handler(_ignore))
    else:
        await nc.subscribe(f"{prefix}.run", cb=handler(on_run))
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes stdin
    if errors:
        print(f"[floor] {role}: " + ", ".join(f"{n} {k}" for k, n in sorted(errors.items())), file=sys.stderr)
    await nc.drain()
    await r.aclose()


async def _ignore(msg) -> None:  # type: ignore[no-untyped-def]
    return None


async def measure(rates: list[float], duration_s: float, session_count: int,
                  layout: str = "3 procs") -> list[dict[str, object]]:
    """Start NATS, Redis and the layout's bare hops; drive calls open loop at each rate; per rate the
    served rate, the wall latency and the CPU a call of each process (the agent apart)."""
    import nats
    from nats.js.api import KeyValueConfig, StorageType

    from talaria.lab.load import measure_rate, open_loop
    from talaria.ops.nats_server import NatsServer
    from talaria.ops.redis_server import RedisServer

    nats_server, redis_server = NatsServer(jetstream=True), RedisServer()
    await nats_server.astart()
    await redis_server.astart()
    prefix = f"floor{uuid.uuid4().hex[:6]}"
    procs: list[subprocess.Popen[str]] = []
    rows: list[dict[str, object]] = []
    nc = await nats.connect(nats_server.url)
    try:
        await nc.jetstream().create_key_value(
            KeyValueConfig(bucket=BUCKET, history=1, ttl=600, replicas=1, storage=StorageType.FILE))
        for role in LAYOUTS[layout]:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "talaria.lab.hop_floor", role, nats_server.url, redis_server.url, prefix],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in procs:
            assert p.stdout is not None
            if (await asyncio.to_thread(p.stdout.readline)).strip() != "ready":
                raise RuntimeError("a bare hop did not start")
        waiting: dict[str, asyncio.Future[None]] = {}

        async def on_inbox(msg) -> None:  # type: ignore[no-untyped-def]
            body = _decode(msg.data)
            if body["what"] == "reply" and (f := waiting.pop(body["call_id"], None)) is not None and not f.done():
                f.set_result(None)

        await nc.subscribe(f"{prefix}.inbox.*", cb=on_inbox)

        async def call(i: int) -> float:
            cid = f"{i % session_count:04d}-{uuid.uuid4().hex}"
            done = waiting[cid] = asyncio.get_running_loop().create_future()
            start = time.perf_counter()
            try:
                await nc.request(f"{prefix}.call", _payload(cid, "call"), timeout=10)
                await asyncio.wait_for(done, 10)
            finally:
                waiting.pop(cid, None)
            return (time.perf_counter() - start) * 1000  # no model time: all of it is added

        await open_loop(50.0, 1.0, call)  # warm up
        pids = {**{role: p.pid for role, p in zip(LAYOUTS[layout], procs)},
                "nats": nats_server.pid, "redis": redis_server.pid}
        pids_by_kind = {k: [pid] for k, pid in pids.items() if pid is not None}

        class _Stack:  # what bus_counts reads
            nats_nodes = [nats_server]
            redis_url = redis_server.url

        for rate in rates:
            rows.append(await measure_rate(rate, duration_s, call, pids_by_kind, _Stack))
    finally:
        await nc.close()
        for p in procs:
            try:
                if p.stdin is not None:
                    p.stdin.close()
                p.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
        await nats_server.astop()
        await redis_server.astop()
    return rows


if __name__ == "__main__":
    try:
        import uvloop  # the services' loop
    except ImportError:  # pragma: no cover
        uvloop = None  # type: ignore[assignment]
    coro = serve(*sys.argv[1:5])
    if uvloop is not None:
        uvloop.run(coro)
    else:  # pragma: no cover
        asyncio.run(coro)
