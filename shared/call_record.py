"""The durable at-most-once record of every call: a JetStream key-value bucket.

Failure model: a node is lost with its disk. Redis replicates asynchronously
(and the embedded one keeps nothing on disk), so the record that a call id was
taken, who generates it and what its reply was lives in a JetStream KV bucket
replicated synchronously over the NATS cluster (three replicas on the
three-node cluster; `TALARIA_CALL_RECORD_REPLICAS`). Every step is a
compare-and-set on the key's revision (`CallRecord`, `shared/schema.py`):

- the router *creates* it (`placing`) — the first placement of a call id wins —
  and records the server it submits the call to (`placed`), before the submit,
  whose revision travels with the call to the engine; a retry reads it:
  answered -> the stored reply again, else pinned to that server;
- the engine-worker *claims* it before it generates (`claimed`, its instance
  and process epoch), on the placement's revision when the run carries it; a
  claim by another worker is never run here, a claim by an earlier process of
  this same worker (it was restarted) is taken over;
- the engine-worker *answers* it (`answered`, the reply) before it publishes
  the reply, on the revision of its own claim: a process whose claim was taken
  over while it hung cannot answer (it is fenced), and a second generation of
  a call id never becomes a second answer.

The router also keeps each open session's model here (`session.` keys), so a
Redis that restarts empty does not turn an agent's open session into an
unknown one: the router restores the session's Redis hash from it.

Transient errors (a NATS node restarting, a stream leader being elected) are
retried up to a deadline; past it `CallRecordUnavailable` is raised. Each request
waits `REQUEST_TIMEOUT_S`, not nats-py's 5 s: a request that went to a stream
leader that died is asked again soon after the election, not 5 s later. Asking
again is safe because every conditional write carries a message id of its own
(`Nats-Msg-Id`): a retry of a write whose first try landed, its ack lost, is
refused as a wrong revision (nats-server checks the expected revision before its
duplicate window), and the refusal is then told apart from a lost race by
reading the key from the stream's leader: if its newest message carries this
write's id, the write landed and its revision is returned. A retry that reaches
the stream while the first try is still being stored is refused as in process
(`WRITE_IN_PROCESS`), which is waited out like a timeout: the next try finds the
write landed, or not.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from dataclasses import dataclass
from typing import Literal

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js.api import DiscardPolicy, Header, KeyValueConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from shared.schema import CallRecord, OpenSessionRecord, call_record_decoder, encode, open_session_record_decoder
from shared.subjects import Subjects

RETRY_DEADLINE_S = 20.0   # wall seconds a step waits out a restarting node or a leader election
REQUEST_TIMEOUT_S = 1.0   # one request's wait for the bucket's answer (then asked again)
_BACKOFF_S = (0.02, 0.05, 0.1, 0.2, 0.5)
# the JetStream error codes a conditional delete is refused with when the key moved on
# (10071: wrong last sequence; 10164 is what the server answered for it in chaos runs)
WRONG_LAST_SEQUENCE = (10071, 10164)
# a retry whose message id the stream is still storing from an earlier try (that try's ack
# was lost while a node stalled): not an answer but "not yet", waited out like a timeout
WRITE_IN_PROCESS = 10158


class CallRecordUnavailable(RuntimeError):
    """The bucket did not answer within the retry deadline."""


def record_key(session_id: str, call_id: str) -> str:
    """Session and call id in the key's alphabet (a call id reused by another session is another key)."""
    raw = f"{session_id}\x1f{call_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def session_key(session_id: str) -> str:
    """An open session's key (the `session.` namespace: no call key has a dot)."""
    return "session." + base64.urlsafe_b64encode(session_id.encode()).decode().rstrip("=")


def epoch_key(role: str, scope: str) -> str:
    """A role's epoch key (the `epoch.` namespace), e.g. admission of one server."""
    return f"epoch.{role}." + base64.urlsafe_b64encode(scope.encode()).decode().rstrip("=")


@dataclass(frozen=True, slots=True)
class Claim:
    """What an engine-worker may do with a run: `run` it (under `revision`), answer
    it with the stored reply (`answered`), or leave it (`held_elsewhere`: another
    worker claimed it)."""

    outcome: Literal["run", "answered", "held_elsewhere"]
    record: CallRecord
    revision: int


def is_transient(exc: BaseException) -> bool:
    """A node restarting or a leader election (timeouts, no responders, a 5xx from
    JetStream, a retry's write still in process): wait it out. A refusal (4xx: wrong
    revision, bad request) is an answer."""
    if isinstance(exc, nats.js.errors.APIError):
        return (exc.code or 0) >= 500 or exc.err_code == WRITE_IN_PROCESS
    return isinstance(exc, (nats.errors.Error, asyncio.TimeoutError, OSError))


async def retry_transient(what: str, step, deadline_s: float,  # type: ignore[no-untyped-def]
                          unavailable: type[Exception] = CallRecordUnavailable):
    """Run `step()` until it answers, waiting out transient errors up to `deadline_s`.
    A step that answered only after retries is logged once with what it waited out
    (`store.retried`): a call that stalled on the bucket is otherwise silent."""
    start = time.monotonic()
    end = start + deadline_s
    attempt = 0
    first_error = ""

    def report(event: str) -> None:
        structlog.get_logger().warning(event, what=what, attempts=attempt + 1, first_error=first_error,
                                       waited_s=round(time.monotonic() - start, 3))

    while True:
        try:
            result = await step()
        except Exception as exc:
            if not is_transient(exc):
                raise
            first_error = first_error or f"{type(exc).__name__}: {exc}"
            if time.monotonic() > end:
                report("store.unavailable")
                raise unavailable(f"{what}: {type(exc).__name__}: {exc}") from exc
            await asyncio.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
            attempt += 1
        else:
            if attempt:
                report("store.retried")
            return result


class CallRecords:
    def __init__(self, kv: KeyValue, js: JetStreamContext, bucket: str, deadline_s: float = RETRY_DEADLINE_S) -> None:
        self.kv = kv
        self.js = js
        self.bucket = bucket
        self.subject_prefix = f"$KV.{bucket}."  # (JetStream KV's subject for a key, and its stream)
        self.stream = f"KV_{bucket}"
        self.deadline_s = deadline_s

    @classmethod
    async def open(cls, nc: NATS, subject_prefix: str, *, replicas: int, ttl_s: float, max_bytes: int | None = None,
                   deadline_s: float = RETRY_DEADLINE_S) -> CallRecords:
        """Create the bucket, or bind to it if it exists (every service may be first).
        `max_bytes`: the bucket's bound, its oldest records dropped past it (see `bound`)."""
        js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        name = Subjects(subject_prefix).call_record_bucket
        config = KeyValueConfig(bucket=name, history=1, ttl=ttl_s, replicas=max(1, replicas), storage=StorageType.FILE)
        end = time.monotonic() + max(deadline_s, 30.0)
        attempt = 0
        while True:
            try:
                try:
                    kv = await js.create_key_value(config)
                except nats.js.errors.BadRequestError:  # exists with another config (e.g. other replicas)
                    kv = await js.key_value(name)
                records = cls(kv, js, name, deadline_s)
                if max_bytes:
                    await records.bound(max_bytes)
                return records
            except Exception as exc:
                if not is_transient(exc) or time.monotonic() > end:
                    hint = (" (is JetStream enabled on the NATS server? the call record needs it: nats-server -js)"
                            if isinstance(exc, nats.js.errors.ServiceUnavailableError) else "")
                    raise CallRecordUnavailable(f"call record bucket {name}: {type(exc).__name__}: {exc}{hint}") from exc
                await asyncio.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
                attempt += 1

    async def bound(self, max_bytes: int) -> None:
        """Hold the bucket to `max_bytes`, its oldest records dropped first once it is full
        (JetStream's discard-old, where a key-value bucket's own discard-new would refuse
        every new call): records are written for every call and kept for hours, so a busy
        fleet had filled the NATS server's JetStream store, and then every call failed. A
        record dropped early is a retry of an old call no longer deduplicated; an admission's
        epoch (rewritten every minute) and an open session's model (also in Redis) are the
        rest of what the bucket holds. The same bound from every process: set once."""
        info = await self.js.stream_info(self.stream)
        if info.config.max_bytes != max_bytes or info.config.discard != DiscardPolicy.OLD:
            await self.js.update_stream(info.config.evolve(max_bytes=max_bytes, discard=DiscardPolicy.OLD))

    async def usage(self) -> tuple[int, float | None]:
        """The bucket's bytes and its oldest record's age in wall seconds (None: it is empty):
        how far back a retry is still deduplicated, once the bound drops records early."""
        state = (await self.js.stream_info(self.stream)).state
        if not state.messages or not state.first_seq:
            return int(state.bytes or 0), None
        try:
            first = await self.js.get_msg(self.stream, seq=state.first_seq)
        except nats.js.errors.NotFoundError:  # (dropped meanwhile: next time)
            return int(state.bytes or 0), None
        age = max(0.0, time.time() - first.time.timestamp()) if first.time is not None else None
        return int(state.bytes or 0), age

    async def _retry(self, what: str, step):  # type: ignore[no-untyped-def]
        return await retry_transient(what, step, self.deadline_s, CallRecordUnavailable)

    # -- the primitive steps ------------------------------------------------------------
    async def _write(self, what: str, key: str, data: bytes, last: int) -> int | None:
        """Write `key` if it is at revision `last` (0: it has no value); its new revision,
        or None when it moved on. One message id for every try (see the module's note)."""
        write_id = uuid.uuid4().hex
        subject = self.subject_prefix + key
        tries = 0

        async def publish(expected: int) -> int | None:
            nonlocal tries
            tries += 1
            try:
                ack = await self.js.publish(subject, data, headers={
                    Header.MSG_ID.value: write_id, Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(expected)})
            except nats.js.errors.APIError as exc:
                if exc.err_code not in WRONG_LAST_SEQUENCE:
                    raise
                return await landed() if tries > 1 else None
            return int(ack.seq)

        async def landed() -> int | None:
            """An earlier try's revision, if it is the key's newest message (its ack was lost)."""
            try:
                msg = await self.js.get_msg(self.stream, subject=subject)
            except nats.js.errors.NotFoundError:
                return None
            return int(msg.seq) if msg.headers and msg.headers.get(Header.MSG_ID.value) == write_id else None

        async def step() -> int | None:
            rev = await publish(last)
            if rev is None and last == 0:
                # "no value" may be a deleted key, whose tombstone has a revision of its own
                try:
                    await self.kv.get(key)
                except nats.js.errors.KeyNotFoundError as gone:  # (deleted: it carries the tombstone)
                    if gone.entry is not None and gone.entry.revision:
                        return await publish(int(gone.entry.revision))
            return rev

        return await self._retry(what, step)

    async def get(self, session_id: str, call_id: str) -> tuple[CallRecord | None, int]:
        """The record and its revision (None, 0 when there is none)."""
        key = record_key(session_id, call_id)

        async def step() -> tuple[CallRecord | None, int]:
            try:
                entry = await self.kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return None, 0
            if not entry.value:
                return None, 0
            return call_record_decoder.decode(entry.value), int(entry.revision or 0)

        return await self._retry("get", step)

    async def create(self, session_id: str, call_id: str, record: CallRecord) -> int | None:
        """Write it if the key has no record; its revision, or None when one exists."""
        return await self._write("create", record_key(session_id, call_id), encode(record), 0)

    async def update(self, session_id: str, call_id: str, record: CallRecord, last: int) -> int | None:
        """Write it if the key is still at revision `last`; the new revision, or None."""
        return await self._write("update", record_key(session_id, call_id), encode(record), last)

    async def release(self, session_id: str, call_id: str, last: int) -> None:
        """Forget a placement nothing took (a retry may place it again)."""
        key = record_key(session_id, call_id)

        async def step() -> None:
            try:
                await self.kv.delete(key, last=last)
            except nats.js.errors.BadRequestError as exc:  # (delete does not name a wrong revision itself)
                if exc.err_code not in WRONG_LAST_SEQUENCE:
                    raise
                # it moved on (a server took it after all): keep it

        await self._retry("release", step)

    # -- the engine-worker's steps ------------------------------------------------------
    async def claim(self, session_id: str, call_id: str, *, server_id: str, owner: str, epoch: str,
                    placed_revision: int = 0) -> Claim:
        """`placed_revision`: the revision of the router's placement on this server, as the
        run carries it: claimed on it at once, without reading the record (one round trip,
        not two); a record that moved on since is read, as without it."""
        mine = CallRecord(state="claimed", server_id=server_id, owner=owner, epoch=epoch)
        if placed_revision and (rev := await self.update(session_id, call_id, mine, placed_revision)) is not None:
            return Claim("run", mine, rev)
        while True:
            record, revision = await self.get(session_id, call_id)
            if record is None:
                rev = await self.create(session_id, call_id, mine)
                if rev is not None:
                    return Claim("run", mine, rev)
                continue
            if record.state == "answered":
                return Claim("answered", record, revision)
            if record.state == "claimed" and record.owner != owner:
                return Claim("held_elsewhere", record, revision)
            if record.state == "claimed" and record.epoch == epoch:
                return Claim("run", record, revision)  # this process again (the earlier run was stopped)
            # placing / placed, or an earlier process of this worker: claim it (fencing that process)
            rev = await self.update(session_id, call_id, mine, revision)
            if rev is not None:
                return Claim("run", mine, rev)

    async def answer(self, session_id: str, call_id: str, reply: bytes, claim: Claim) -> tuple[bytes | None, bool]:
        """Store the reply on the claim's revision. Returns (the reply to publish,
        whether it is this one): the stored first answer if there is one, or None
        when this process's claim was taken over (fenced: publish nothing). A record
        the bucket dropped while the call ran (its bound, its TTL), or one a retry placed
        again since, is answered all the same: else nobody answered the call, and its
        server's admission counted it as running for ever (a probe's bucket at its
        smallest bound stalled two servers so)."""
        answered = CallRecord(state="answered", server_id=claim.record.server_id, owner=claim.record.owner,
                              epoch=claim.record.epoch, reply=reply)
        revision = claim.revision
        while True:
            if await self.update(session_id, call_id, answered, revision) is not None:
                return reply, True
            record, revision = await self.get(session_id, call_id)
            if record is not None and record.state == "answered" and record.reply is not None:
                return record.reply, record.reply == reply
            if record is not None and record.state == "claimed":
                return None, False  # another process's claim: fenced
            # dropped (revision 0: created afresh) or placed again: answered on what is there

    # -- epochs: who is the newest process of a role (admission's fence) -----------------
    async def take_epoch(self, role: str, scope: str) -> tuple[int, int]:
        """Become the newest holder of `role` for `scope` (an admission for its server):
        above the stored epoch and at least the wall clock in milliseconds, written by
        compare-and-set, so two processes never hold one epoch, and a successor's epoch is
        newer than its predecessors' even where the bounded bucket dropped their record
        (counting up from 1 again, it would be refused as older by every engine).
        Returns (epoch, revision)."""
        key = epoch_key(role, scope)
        while True:
            current, revision = await self.current_epoch(role, scope)
            epoch = max(current + 1, int(time.time() * 1000))
            # None: another process took one meanwhile: read again
            rev = await self._write("take epoch", key, str(epoch).encode(), revision)
            if rev is not None:
                return epoch, rev

    async def current_epoch(self, role: str, scope: str) -> tuple[int, int]:
        """The newest epoch of `role` for `scope` and its revision ((0, 0): none yet)."""
        key = epoch_key(role, scope)

        async def step() -> tuple[int, int]:
            try:
                entry = await self.kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return 0, 0
            try:
                return int((entry.value or b"0").decode()), int(entry.revision or 0)
            except ValueError:
                return 0, int(entry.revision or 0)

        return await self._retry("epoch", step)

    async def refresh_epoch(self, role: str, scope: str, epoch: int, revision: int) -> int | None:
        """Write our epoch again (the bucket's TTL, or its bound, would drop it under a
        long-lived holder); the new revision, or None when a newer holder has taken it.
        A record dropped meanwhile is written again."""
        key = epoch_key(role, scope)
        while True:
            rev = await self._write("refresh epoch", key, str(epoch).encode(), revision)
            if rev is not None:
                return rev
            current, revision = await self.current_epoch(role, scope)
            if current > epoch:
                return None

    # -- open sessions (the router's) ---------------------------------------------------
    async def open_session(self, session_id: str, model: str, owner: str, tenant: str | None = None) -> None:
        """A session is open for `model` (by `owner`, for `tenant`) until it ends: kept here
        too, so a Redis that restarts empty does not make an agent's open session unknown."""
        key, value = session_key(session_id), encode(OpenSessionRecord(model=model, owner=owner, tenant=tenant))

        async def step() -> None:
            await self.kv.put(key, value)

        await self._retry("open session", step)

    async def open_session_record(self, session_id: str) -> OpenSessionRecord | None:
        key = session_key(session_id)

        async def step() -> OpenSessionRecord | None:
            try:
                entry = await self.kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return None
            if not entry.value:
                return None
            try:
                return open_session_record_decoder.decode(entry.value)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return None  # not ours (a bucket shared by mistake): as if never opened

        return await self._retry("session", step)

    async def end_session(self, session_id: str) -> None:
        key = session_key(session_id)

        async def step() -> None:
            await self.kv.delete(key)

        await self._retry("end session", step)

    async def answered_reply(self, session_id: str, call_id: str) -> bytes | None:
        record, _ = await self.get(session_id, call_id)
        return record.reply if record is not None and record.state == "answered" else None
