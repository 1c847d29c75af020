"""Prompts by reference: one JetStream object store per agent namespace.

Router and admission decide on token counts alone, so a large real prompt (a
100k-token conversation as text and ids is over NATS's 1 MiB message limit,
and admission keeps every `SubmitCall` it holds) does not ride the bus: the
agent client puts it, encoded as a `PromptPayload`, into its namespace's
bucket under the call's key, and sends `CallRequest.prompt_ref` instead.
The router turns that into a `PromptRef` whose namespace is the call's
subject's (so nobody can point an engine at another namespace's prompt); the
engine-worker that claims the call reads it and deletes it once the call is
answered or refused. Objects nobody deletes (a call refused before it was
placed) age out with the bucket's TTL, the call record's; the bucket's size
is bounded (`TALARIA_PROMPT_STORE_MAX_BYTES`).

Who may do what is in `shared/auth.py`: an agent-facing user writes only its
own namespace's bucket, the engine reads and deletes in every one, the router
creates them.
"""

from __future__ import annotations

import asyncio

import msgspec
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.object_store import ObjectStore

from shared.call_record import RETRY_DEADLINE_S, record_key, retry_transient
from shared.schema import PromptPayload, PromptRef
from shared.subjects import Subjects

_payload_decoder = msgspec.msgpack.Decoder(PromptPayload)
GET_TIMEOUT_S = 5.0  # wall seconds one read of a prompt may take before it is looked at again


STORE_FAILED = 10077  # JetStream's "store failed": with "maximum bytes exceeded", the bucket is full
FULL_RETRY_AFTER_S = 2.0  # what a caller refused for a full bucket is told to wait: its calls' prompts go as they end


class PromptStoreUnavailable(RuntimeError):
    """The prompt store did not answer within the retry deadline, or is not there."""


class PromptStoreFull(RuntimeError):
    """The namespace's bucket holds its `TALARIA_PROMPT_STORE_MAX_BYTES`: an answer, not an
    outage, so it is not waited out (a flood of large prompts from one tenant had held every
    other tenant's large prompt for the retry deadline, 20 s, then failed it as internal)."""


def is_full(exc: BaseException) -> bool:
    return (isinstance(exc, nats.js.errors.APIError) and exc.err_code == STORE_FAILED
            and "maximum bytes" in (exc.description or ""))


def object_name(session_id: str, call_id: str) -> str:
    """A call's object: its session and call id, as the call record keys them."""
    return record_key(session_id, call_id)


def encode_payload(payload: PromptPayload) -> bytes:
    return msgspec.msgpack.encode(payload)


class PromptStore:
    def __init__(self, nc: NATS, subject_prefix: str, deadline_s: float = RETRY_DEADLINE_S) -> None:
        self.js = nc.jetstream()
        self.subjects = Subjects(subject_prefix)
        self.deadline_s = deadline_s
        self._stores: dict[str, ObjectStore] = {}

    async def create(self, namespaces: list[str], *, replicas: int, ttl_s: float, max_bytes: int) -> None:
        """Create each namespace's bucket, or leave it as it is (the router, at start-up)."""
        for ns in namespaces:
            bucket = self.subjects.prompt_bucket(ns)
            config = ObjectStoreConfig(description=f"prompts sent by reference, namespace {ns}", ttl=ttl_s,
                                       max_bytes=max_bytes, storage=StorageType.FILE, replicas=max(1, replicas))

            async def step(bucket: str = bucket, config: ObjectStoreConfig = config) -> ObjectStore:
                try:
                    return await self.js.create_object_store(bucket, config=config)
                except nats.js.errors.BadRequestError:  # exists with another config
                    return await self.js.object_store(bucket)

            self._stores[ns] = await retry_transient(f"prompt store {bucket}", step, max(self.deadline_s, 30.0),
                                                     PromptStoreUnavailable)

    async def _store(self, ns: str) -> ObjectStore:
        store = self._stores.get(ns)
        if store is None:
            bucket = self.subjects.prompt_bucket(ns)

            async def step() -> ObjectStore:
                return await self.js.object_store(bucket)

            try:
                store = await retry_transient(f"prompt store {bucket}", step, self.deadline_s, PromptStoreUnavailable)
            except nats.js.errors.BucketNotFoundError:
                raise PromptStoreUnavailable(f"prompt store {bucket} does not exist (the router creates it at start-up)"
                                             ) from None
            self._stores[ns] = store
        return store

    async def put(self, ns: str, name: str, data: bytes) -> None:
        store = await self._store(ns)

        async def step() -> None:
            try:
                await store.put(name, data)
            except nats.js.errors.APIError as exc:
                if is_full(exc):
                    raise PromptStoreFull(f"the prompt store of namespace {ns} is full") from None
                raise

        await retry_transient("put prompt", step, self.deadline_s, PromptStoreUnavailable)

    async def get(self, ref: PromptRef) -> PromptPayload | None:
        """The prompt, or None when it is not (or no longer) there."""
        store = await self._store(ref.namespace)

        async def step() -> PromptPayload | None:
            try:
                # (bounded: nats-py reads the chunks through a consumer that waits for ever when
                # they are purged under it, by a delete racing this read)
                got = await asyncio.wait_for(store.get(ref.name), GET_TIMEOUT_S)
            except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
                return None
            except asyncio.TimeoutError:
                try:
                    await store.get_info(ref.name)
                except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
                    return None  # deleted while we read it
                raise  # still there: a slow node, read again (transient)
            try:
                return _payload_decoder.decode(got.data or b"")
            except (msgspec.DecodeError, msgspec.ValidationError):
                return None  # not a prompt: as if it were not there

        return await retry_transient("get prompt", step, self.deadline_s, PromptStoreUnavailable)

    async def delete(self, ref: PromptRef) -> None:
        store = await self._store(ref.namespace)

        async def step() -> None:
            try:
                await store.delete(ref.name)
            except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
                pass

        await retry_transient("delete prompt", step, self.deadline_s, PromptStoreUnavailable)
