"""`talaria bench-gateway`: what the HTTP front door adds over a direct NATS agent client.

Brings up the embedded stack with the gateway on the sim engine (one model,
a high time scale, one output token, so the engine's own time is small and
the same on both paths), then for each conversation size makes the same
calls at a fixed rate, alternating between two paths (each at half the
rate, so a pause of the machine falls on both): through the agent client on NATS,
and through the gateway over loopback HTTP. Prints both latency
distributions (wall milliseconds) and the overhead at p50 and p99 (the
differences of the two paths' percentiles). Not a timed test: a busy
machine moves the figures; compare the columns of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import time
import uuid
from pathlib import Path

from talaria.argtypes import positive_float, positive_int
from talaria.lab.load import paced_wall_ms, percentile

MODEL = "glm-4.5-air-fp8"


async def bench(sizes: list[int], calls: int, rate: float, log_dir: Path) -> list[dict[str, float]]:
    import aiohttp

    from shared.agent_client import TalariaClient
    from shared.policy import resolve_policy
    from talaria.ops.stack import EmbeddedStack, StackSpec

    spec = StackSpec(policy=resolve_policy("baseline"), models=[MODEL], time_scale=1000.0, log_dir=log_dir,
                     gateway=True)
    rows: list[dict[str, float]] = []
    async with EmbeddedStack(spec) as stack:
        client = await TalariaClient.connect(stack.nats_urls, subject_prefix=stack.subject_prefix,
                                             **stack.nats_auth("agent"))
        headers = {"Authorization": f"Bearer {stack.api_key}"}
        try:
            async with aiohttp.ClientSession() as http:
                for size in sizes:
                    text = "x" * (size * 4 - 16)  # the gateway's estimate: ~4 bytes a token
                    tag = uuid.uuid4().hex[:6]
                    session = await client.open_session(MODEL, session_id=f"bench-{tag}-{size}")

                    async def direct(i: int) -> None:
                        await session.call(prompt_tokens=size, max_tokens=1, call_id=f"bench-{tag}-{size}-{i}",
                                           prompt_text=text)

                    async def via_http(i: int) -> None:
                        body = {"model": MODEL, "max_tokens": 1,
                                "messages": [{"role": "user", "content": f"{tag}-{i} {text}"}]}
                        async with http.post(f"{stack.openai_base_url}/chat/completions", json=body,
                                             headers={**headers, "x-session-id": f"bench-{tag}-{size}"}) as r:
                            assert r.status == 200, await r.text()
                            await r.read()

                    await paced_wall_ms(min(10, calls), rate, direct)  # warm both paths
                    await paced_wall_ms(min(10, calls), rate, via_http)
                    # `rate` calls/s in all, alternating paths (each path at half of it)
                    t0 = time.monotonic()
                    d, h = await asyncio.gather(paced_wall_ms(calls, rate / 2, direct, start_at=t0),
                                                paced_wall_ms(calls, rate / 2, via_http, start_at=t0 + 1 / rate))
                    rows.append({"tokens": size, "direct_p50": statistics.median(d), "direct_p99": percentile(d, 0.99),
                                 "http_p50": statistics.median(h), "http_p99": percentile(h, 0.99),
                                 "overhead_p50": statistics.median(h) - statistics.median(d),
                                 "overhead_p99": percentile(h, 0.99) - percentile(d, 0.99)})
        finally:
            await client.close()
    return rows


def prefix_cost(sizes: list[int], repeats: int = 30) -> list[dict[str, float]]:
    """The gateway's own work per call for prefix identity (pure, no I/O), per conversation
    size: render the conversation into token ids, hash its blocks, and compare the chain
    with the session's stored one (unpacked from its Redis bytes). Median wall ms."""
    from services.gateway import prefix as px
    from services.gateway import translate as tr

    rows = []
    for size in sizes:
        turn = "tool output line, with some code: x = f(y) + 1\n" * 32  # ~400 tokens a message
        messages = [{"role": "system", "content": "you are a coding agent"}]
        while tr.chat_prompt(messages).tokens < size:
            messages += [{"role": "assistant", "content": turn[:200]}, {"role": "user", "content": turn}]
        before = tr.chat_prompt(messages[:-1]).ids  # the last call's prompt and reply, as the engine holds them
        stored = px.pack(px.block_hashes(before))
        render, chain, cached, compare = [], [], [], []
        for _ in range(repeats):
            cache = px.ChainCache()
            cache.chain("t", before)
            t0 = time.perf_counter()
            prompt = tr.chat_prompt(messages)
            t1 = time.perf_counter()
            hashes = px.block_hashes(prompt.ids)
            t2 = time.perf_counter()
            cache.chain("t", prompt.ids)
            t3 = time.perf_counter()
            px.common_blocks(px.unpack(stored), hashes)
            t4 = time.perf_counter()
            render.append(t1 - t0)
            chain.append(t2 - t1)
            cached.append(t3 - t2)
            compare.append(t4 - t3)
        rows.append({"tokens": tr.chat_prompt(messages).tokens, "render_ms": statistics.median(render) * 1e3,
                     "hash_ms": statistics.median(chain) * 1e3, "cached_hash_ms": statistics.median(cached) * 1e3,
                     "compare_ms": statistics.median(compare) * 1e3,
                     "chain_kb": len(stored) / 1024})
    return rows


def tokenizer_cost(sizes: list[int], folder: str | None, repeats: int = 10) -> list[dict[str, float]]:
    """With a model's own chat template and tokenizer (services/gateway/tokens.py): render the
    conversation, encode it whole, and encode it incrementally from the replica's encoder,
    which holds the last call's text (an agent's next turn appends two messages). Median
    wall ms. `folder`: a model folder; None: the tiny local model's tokenizer."""
    import tempfile

    from services.gateway import tokens as tk

    with tempfile.TemporaryDirectory() as tmp:
        if folder is None:
            from talaria.ops.tinymodel import TinySpec, build_tokenizer

            build_tokenizer(TinySpec(), Path(tmp))
            folder = tmp
        tok = tk.ChatTokenizer(folder)
        rows = []
        for size in sizes:
            turn = "tool output line, with some code: x = f(y) + 1\n" * 32
            messages = [{"role": "system", "content": "you are a coding agent"}, {"role": "user", "content": turn[:200]}]
            while len(messages) < 4 or len(tok.encode_whole(tok.render(messages, None))) < size:
                messages += [{"role": "assistant", "content": turn[:200]}, {"role": "user", "content": turn}]
            before, text = tok.render(messages[:-2], None), tok.render(messages, None)
            render, whole, appended = [], [], []
            for i in range(repeats):
                enc = tk.IncrementalEncoder(tok.encoder._encode, tok.encoder.added_ids)
                enc.encode("t", before)
                t0 = time.perf_counter()
                tok.render(messages, None)
                t1 = time.perf_counter()
                ids = tok.encode_whole(text)
                t2 = time.perf_counter()
                inc = enc.encode("t", text)
                t3 = time.perf_counter()
                assert list(inc) == ids
                render.append(t1 - t0)
                whole.append(t2 - t1)
                appended.append(t3 - t2)
            rows.append({"tokens": len(ids), "render_ms": statistics.median(render) * 1e3,
                         "encode_ms": statistics.median(whole) * 1e3, "appended_ms": statistics.median(appended) * 1e3})
    return rows


def run(a: argparse.Namespace) -> int:
    sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
    print(f"{'tokens':>8} {'ids ms':>7} {'hash ms':>8} {'cached ms':>10} {'compare ms':>11} {'chain KB':>9}   "
          "(prefix identity, the gateway's pure work per call, median wall ms; cached: hashing only what the "
          "last turn appended, from the replica's chain cache)")
    for r in prefix_cost(sizes):
        print(f"{r['tokens']:>8} {r['render_ms']:>7.2f} {r['hash_ms']:>8.2f} {r['cached_hash_ms']:>10.3f} "
              f"{r['compare_ms']:>11.3f} {r['chain_kb']:>9.1f}")
    if a.tokenizer is not None or importlib.util.find_spec("transformers") is not None:
        print(f"{'tokens':>8} {'render ms':>10} {'encode whole ms':>16} {'encode appended ms':>19}   "
              "(the model's own chat template and tokenizer: "
              f"{a.tokenizer or 'the tiny local model'}; median wall ms)")
        for r in tokenizer_cost(sizes, a.tokenizer):
            print(f"{r['tokens']:>8} {r['render_ms']:>10.2f} {r['encode_ms']:>16.2f} {r['appended_ms']:>19.2f}")
    else:
        print("(the model's own chat template and tokenizer are not measured: they need transformers and the "
              "tiny local model, which `make vllm-cpu` installs, or --tokenizer FOLDER)")
    if a.prefix_only:
        return 0
    rows = asyncio.run(bench(sizes, a.calls, a.rate, Path(a.log_dir)))
    print(f"{'tokens':>8} {'direct p50':>11} {'direct p99':>11} {'http p50':>9} {'http p99':>9} "
          f"{'overhead p50':>13} {'overhead p99':>13}   (wall ms per call, {a.calls} calls a path, {a.rate:g}/s in all, alternating)")
    for r in rows:
        print(f"{r['tokens']:>8} {r['direct_p50']:>11.2f} {r['direct_p99']:>11.2f} {r['http_p50']:>9.2f} "
              f"{r['http_p99']:>9.2f} {r['overhead_p50']:>13.2f} {r['overhead_p99']:>13.2f}")
    return 0


def configure_parser(p: argparse.ArgumentParser, default_log_dir: Path) -> None:
    p.add_argument("--sizes", default="1000,32000,100000", help="conversation sizes in tokens (comma-separated)")
    p.add_argument("--calls", type=positive_int, default=200, help="calls per size and path")
    p.add_argument("--rate", type=positive_float, default=100.0,
                   help="calls started per second, both paths together (alternating)")
    p.add_argument("--log-dir", default=str(default_log_dir), help="the embedded stack's logs")
    p.add_argument("--prefix-only", action="store_true", help="only the prefix-identity tables (no stack)")
    p.add_argument("--tokenizer", default=None,
                   help="a model folder whose chat template and tokenizer to time (default: the tiny local model's, "
                        "when transformers is installed)")
    p.set_defaults(fn=run)
