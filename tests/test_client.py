"""The agent client against a scripted responder on a real NATS (no services).

The responder answers each call with a burst of streamed tokens and the reply, so
an agent's cancellation lands while messages are arriving: the case where a
cancellation raced by a message used to be lost (nats-py's `next_msg` waits with
`asyncio.wait_for`, which on Python 3.11 can swallow it) and the agent kept
waiting for a reply it had given up on.
"""

from __future__ import annotations

import asyncio
import socket
import stat
import uuid
from pathlib import Path

import msgspec
import pytest

from shared.schema import CallReply, CallRequest, CallRunning, CallTokens, CancelCall, encode
from shared.subjects import Subjects
from talaria.client import AgentLogin, Deployment, TalariaClient
from talaria.ops.nats_server import NatsServer

BURST_TOKENS = 40  # streamed events per call, all published back to back


def _reply(req: CallRequest) -> CallReply:
    return CallReply(call_id=req.call_id, session_id=req.session_id, server_id="s0", model=req.model,
                     prompt_tokens=req.prompt_tokens, cached_tokens=0, restored_tokens=0, reprefill_tokens=0,
                     output_tokens=BURST_TOKENS, arrived_at=0.0, finished_at=1.0, waited_s=0.0, switch_wait_s=0.0,
                     round_wait=False, restore_s=0.0, prefill_s=0.0, decode_s=1.0, engine="vllm")


async def test_cancel_during_a_token_burst_raises_and_tells_the_engine(nats_server: NatsServer) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    subjects = Subjects(prefix)
    request_decoder = msgspec.json.Decoder(CallRequest)
    cancels: list[str] = []
    async with await TalariaClient.connect(nats_server.url, subject_prefix=prefix, silence_s=5.0) as client:
        nc = client.nc

        cancelled: dict[str, asyncio.Event] = {}

        async def stream(req: CallRequest) -> None:
            for i in range(BURST_TOKENS):
                await nc.publish(req.reply_to, encode(CallTokens(call_id=req.call_id, index=i, token_ids=[i])))
            # the reply only if the agent has not given up within a second (an engine aborts a cancelled call)
            try:
                await asyncio.wait_for(cancelled.setdefault(req.call_id, asyncio.Event()).wait(), 1.0)
            except TimeoutError:
                await nc.publish(req.reply_to, encode(_reply(req)))

        async def responder(msg) -> None:  # type: ignore[no-untyped-def]
            asyncio.create_task(stream(request_decoder.decode(msg.data)))

        async def on_cancel(msg) -> None:  # type: ignore[no-untyped-def]
            call_id = msgspec.json.decode(msg.data, type=CancelCall).call_id
            cancels.append(call_id)
            cancelled.setdefault(call_id, asyncio.Event()).set()

        await nc.subscribe(subjects.api_call(), cb=responder)
        await nc.subscribe(subjects.call_cancel(), cb=on_cancel)
        await nc.flush()

        # a whole call first: the burst is collected in order, the reply comes after a second
        whole = await client.call("sess", "m", prompt_tokens=10, max_tokens=BURST_TOKENS, call_id="whole")
        assert whole.token_ids == list(range(BURST_TOKENS))

        # then give up after the first token, many times over (the race is a matter of timing)
        for n in range(30):
            first = asyncio.Event()
            call = asyncio.create_task(client.call(
                "sess", "m", prompt_tokens=10, max_tokens=BURST_TOKENS, call_id=f"c{n}",
                on_event=lambda ev: first.set() if isinstance(ev, CallTokens) else None))
            await asyncio.wait_for(first.wait(), 5)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        await nc.flush()
        await asyncio.sleep(0.1)
    assert sorted(cancels) == sorted(f"c{n}" for n in range(30)), "every call given up on is cancelled at the engine"


async def test_an_open_call_is_asked_again_as_soon_as_the_connection_is_back(tmp_path: Path) -> None:
    """What is published to an agent while its connection is away (a NATS restart) is
    lost to it, its call's reply among it (a probe: a reply sent just after a NATS
    restart, before the agent's client was back, was asked for again only after its
    15-s silence). Here the router stand-in answers a call's first ask with `running`
    only and its next ask with the reply: the client asks again as soon as it is back,
    not after its silence (30 s here)."""
    import nats as nats_mod

    server = NatsServer(log_file=tmp_path / "nats.log")
    server.start(timeout=30)
    try:
        prefix = f"t{uuid.uuid4().hex[:8]}"
        request_decoder = msgspec.json.Decoder(CallRequest)
        asked: list[str] = []
        router = await nats_mod.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)

        async def on_call(msg) -> None:  # type: ignore[no-untyped-def]
            req = request_decoder.decode(msg.data)
            asked.append(req.call_id)
            await router.publish(req.reply_to, encode(
                CallRunning(call_id=req.call_id, server_id="s0") if len(asked) == 1 else _reply(req)))

        await router.subscribe(Subjects(prefix).api_call(), cb=on_call)
        await router.flush()
        async with await TalariaClient.connect(server.url, subject_prefix=prefix, silence_s=30.0) as client:
            running = asyncio.Event()
            call = asyncio.create_task(client.call("sess", "m", prompt_tokens=10, max_tokens=8, call_id="c1",
                                                   on_event=lambda ev: isinstance(ev, CallRunning) and running.set()))
            await asyncio.wait_for(running.wait(), 10)
            await asyncio.to_thread(server.restart, 30)
            reply = await asyncio.wait_for(call, 10)
            assert reply.call_id == "c1" and asked == ["c1", "c1"]
        await router.close()
    finally:
        server.stop()


async def test_connect_to_nothing_is_a_connection_error_after_the_timeout() -> None:

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}.*after 1 s"):
        await TalariaClient.connect(f"nats://127.0.0.1:{port}", connect_timeout_s=1.0)


def test_deployment_file_round_trip_and_errors(tmp_path: Path) -> None:

    dep = Deployment(nats_urls=["nats://h:4222", "nats://h:4223"], subject_prefix="tal1", agent=AgentLogin("agent", "pw"),
                     redis_url="redis://u:p@h:6379/0", key_prefix="tal1:")
    f = tmp_path / "credentials.json"
    dep.write(f)
    assert Deployment.load(f) == dep
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    for content, fragment in [("{", "not JSON"), ('{"subject_prefix": "x"}', "missing required field `nats_urls`"),
                              ('{"nats_urls": []}', "`nats_urls` is empty"), ('{"nats_urls": "nats://h"}', "Expected `array`")]:
        f.write_text(content)
        with pytest.raises(ValueError, match=fragment):
            Deployment.load(f)
    with pytest.raises(ValueError, match="cannot read the credentials file"):
        Deployment.load(tmp_path / "missing.json")


async def test_a_session_refuses_what_cannot_fit_and_calls_after_its_end(nats_server: NatsServer) -> None:
    # both refused in the client, before anything is sent: the first would be
    # refused by the engine after queueing, the second silently reopened the session
    from shared.schema import Ok
    from talaria.client import ContextLimit, Session, SessionEnded

    prefix = f"t{uuid.uuid4().hex[:8]}"
    subjects = Subjects(prefix)
    sent: list[CallRequest] = []
    request_decoder = msgspec.json.Decoder(CallRequest)
    async with await TalariaClient.connect(nats_server.url, subject_prefix=prefix, silence_s=5.0) as client:
        nc = client.nc

        async def responder(msg) -> None:  # type: ignore[no-untyped-def]
            req = request_decoder.decode(msg.data)
            sent.append(req)
            await nc.publish(req.reply_to, encode(_reply(req)))

        async def end(msg) -> None:  # type: ignore[no-untyped-def]
            await msg.respond(encode(Ok()))

        await nc.subscribe(subjects.api_call(), cb=responder)
        await nc.subscribe(subjects.api_session_end(), cb=end)
        await nc.flush()
        session = Session(client, "sess", "m", context_limit=1000)
        with pytest.raises(ContextLimit, match="900 tokens \\+ max_tokens 200 = 1100 passes m's context limit of 1000"):
            await session.call(prompt_tokens=900, max_tokens=200)
        reply = await session.call(prompt_tokens=900, max_tokens=100, call_id="fits")  # exactly at the limit
        assert reply.call_id == "fits"
        await session.end()
        with pytest.raises(SessionEnded, match="sess has ended"):
            await session.call(prompt_tokens=10, max_tokens=10)
        await nc.flush()
    assert [r.call_id for r in sent] == ["fits"]
