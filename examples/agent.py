"""A minimal tool-using agent against a running Talaria.

    talaria up --policy talaria                  # in one terminal
    python examples/agent.py                     # in another (from the checkout, .venv active)
    python examples/agent.py --credentials FILE  # another deployment's credentials file

The agent opens a session, makes a few calls whose prompts grow as an agent's
do (the previous context, the model's answer, then the tool's output), runs a
"tool" between calls, ends the session and closes the client.

What a call carries:

- `prompt_tokens`: the whole prompt's length in tokens, and `prefix_tokens`:
  how many of them this session already sent (the previous prompt plus the
  previous output). Placement and admission decide on these counts: the
  prefix is what a server holding the session's KV need not compute again.
  The prompt must leave room for `max_tokens` in the model's context
  (`session.context_limit`); the client refuses the call otherwise.
- `prompt_text` or `prompt_token_ids`: the prompt itself, for a real engine
  (`TALARIA_ENGINE=vllm`). The sim engine reads only the counts, and its
  reply has `text` and `token_ids` set to None: it models how long a call
  takes, not what the model says (`output_tokens` is how many tokens it
  would have produced; `sim_output_tokens` tells it where to stop).
- `TokenSession` (below, `--tokens`) keeps a session's context as token ids:
  each prompt is the previous prompt's ids + the ids the model returned +
  the new input's ids, never re-tokenized text, so a real engine's prefix
  cache sees exactly the same prefix and `prefix_tokens` is always right.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from talaria.client import Deployment, TalariaClient, TokenSession

MODEL = "glm-4.5-air-fp8"


async def counted_agent(client: TalariaClient, calls: int) -> None:
    """Counts only: what a replayed trace sends (any engine)."""
    session = await client.open_session(MODEL)
    context = 0  # tokens the session has sent and received so far
    try:
        for i in range(calls):
            new_input = 4000 if i == 0 else 600  # the task first, then each tool's output
            reply = await session.call(prompt_tokens=context + new_input, prefix_tokens=context,
                                       max_tokens=1024, sim_output_tokens=150,
                                       call_id=f"{session.session_id}#{i:03d}")
            print(f"call {i}: server {reply.server_id}, prompt {reply.prompt_tokens} tokens "
                  f"({reply.cached_tokens} cached), {reply.output_tokens} out, waited {reply.waited_s:.1f} model s, "
                  f"text={reply.text!r}")  # None on the sim engine
            context = reply.prompt_tokens + reply.output_tokens
            await asyncio.sleep(0.2)  # the tool runs
    finally:
        await session.end()


async def token_agent(client: TalariaClient, calls: int) -> None:
    """Token ids: what an agent on a real engine sends (`TALARIA_ENGINE=vllm`)."""
    session = TokenSession(await client.open_session(MODEL))
    try:
        for i in range(calls):
            new_input_ids = list(range(10, 110)) if i == 0 else list(range(200, 240))  # a tokenizer's output
            reply = await session.call(new_input_ids, max_tokens=16, sim_output_tokens=8)
            print(f"call {i}: prompt {reply.prompt_tokens} tokens, {reply.cached_tokens} cached; "
                  f"context now {len(session.context)} token ids")
            await asyncio.sleep(0.2)
    finally:
        await session.session.end()


async def main() -> int:
    p = argparse.ArgumentParser(description="a minimal agent against a running Talaria")
    p.add_argument("--credentials", default=".talaria/logs/up/credentials.json",
                   help="the credentials file `talaria up` writes (default .talaria/logs/up/credentials.json)")
    p.add_argument("--calls", type=int, default=3, help="calls in the session (default 3)")
    p.add_argument("--tokens", action="store_true", help="send token ids through a TokenSession")
    a = p.parse_args()
    try:
        client = await TalariaClient.from_deployment(Deployment.load(a.credentials))
    except (ValueError, ConnectionError) as exc:  # no `talaria up` running, or it is not reachable
        print(f"no deployment: start `talaria up`, or give --credentials ({exc})", file=sys.stderr)
        return 2
    try:
        await (token_agent if a.tokens else counted_agent)(client, a.calls)
    finally:
        await client.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
