"""`talaria bench-tenants`: how long one tenant's call waits behind another tenant's flood.

Brings up the embedded stack with the gateway on the sim engine (one model)
and two tenants. The quiet tenant makes one small call alone, then the
flooding tenant sends many large calls at once (their KV far beyond the
engine's), and a few wall seconds later the quiet tenant makes the same small
call again. Prints the quiet call's latency alone and during the flood, and
the flood's own (wall seconds at the stack's time scale). Admission takes
tenants in turn where not every queued call fits (docs/scheduler.md, rule 2),
so the quiet call waits for the first of the flood's running calls to end,
not for the flood. Not a timed test: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from talaria.argtypes import positive_float, positive_int

MODEL = "glm-4.5-air-fp8"
QUIET, FLOODING = ("quiet", "sk-bench-quiet"), ("flooding", "sk-bench-flooding")


async def bench(flood: int, prompt_words: int, output_tokens: int, time_scale: float, after_s: float,
                log_dir: Path) -> dict[str, float]:
    import aiohttp

    from shared.policy import resolve_policy
    from talaria.ops.stack import EmbeddedStack, StackSpec

    spec = StackSpec(policy=resolve_policy("talaria"), models=[MODEL], time_scale=time_scale, log_dir=log_dir,
                     gateway=True, api_keys=dict((QUIET, FLOODING)))
    async with EmbeddedStack(spec) as stack, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)) as http:
        url = f"{stack.openai_base_url}/chat/completions"

        async def call(key: str, session: str, words: int, out: int) -> float:
            t0 = time.monotonic()
            body = {"model": MODEL, "max_tokens": out, "talaria": {"sim_output_tokens": out},
                    "messages": [{"role": "user", "content": "word " * words}]}
            async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}", "x-session-id": session}) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
                await r.read()
            return time.monotonic() - t0

        alone = await call(QUIET[1], "quiet-0", 1000, 50)
        flooding = [asyncio.ensure_future(call(FLOODING[1], f"flood-{i}", prompt_words, output_tokens))
                    for i in range(flood)]
        await asyncio.sleep(after_s)
        during = await call(QUIET[1], "quiet-1", 1000, 50)
        took = sorted(await asyncio.gather(*flooding))
    return {"quiet_alone_s": alone, "quiet_during_flood_s": during, "flood_p50_s": took[len(took) // 2],
            "flood_max_s": took[-1]}


def run(a: argparse.Namespace) -> int:
    print(f"{a.flood} calls of {a.prompt_words}-word prompts and {a.output_tokens} output tokens from one tenant; "
          f"one small call of another {a.after_s:g} s after they start (wall s at {a.time_scale:g}x) ...", flush=True)
    out = asyncio.run(bench(a.flood, a.prompt_words, a.output_tokens, a.time_scale, a.after_s, Path(a.log_dir)))
    print(f"the quiet tenant's call alone:           {out['quiet_alone_s']:7.2f} s")
    print(f"the quiet tenant's call during the flood: {out['quiet_during_flood_s']:7.2f} s")
    print(f"the flood's calls, p50 / max:             {out['flood_p50_s']:7.2f} / {out['flood_max_s']:.2f} s")
    return 0


def configure_parser(p: argparse.ArgumentParser, default_log_dir: Path) -> None:
    p.add_argument("--flood", type=positive_int, default=150, help="the flooding tenant's calls, sent at once")
    p.add_argument("--prompt-words", type=positive_int, default=50_000, help="words of each flood call's prompt")
    p.add_argument("--output-tokens", type=positive_int, default=8000, help="output tokens of each flood call")
    p.add_argument("--time-scale", type=positive_float, default=20.0, help="the stack's time scale (default 20)")
    p.add_argument("--after-s", type=positive_float, default=3.0,
                   help="wall seconds after the flood starts that the quiet tenant calls")
    p.add_argument("--log-dir", default=str(default_log_dir), help="the embedded stack's logs")
    p.set_defaults(fn=run)
