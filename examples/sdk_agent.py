"""A small tool-using agent written only with an official SDK (OpenAI's chat completions
or Responses API, or Anthropic's Messages): nothing of Talaria is imported. Point it at
any OpenAI- or Anthropic-compatible endpoint; against `talaria up` it shows what
Talaria does for an agent's session.

    talaria up --policy talaria                                   # one terminal
    python examples/sdk_agent.py                                  # another: the OpenAI SDK
    python examples/sdk_agent.py --api anthropic                  # the same loop, the Anthropic SDK
    python examples/sdk_agent.py --api responses                  # the OpenAI SDK's Responses API (as Codex)
    python examples/sdk_agent.py --base-url URL --api-key KEY     # another deployment

Each turn the model is offered three tools that run here, on a folder of files
(`--root`, default this checkout): `list_files`, `read_file` and `search`. The
agent runs every call the model makes, appends the call and its result to the
conversation and asks again, `--calls` times; the conversation only grows, as a
coding agent's does. It sends no session header (`--session NAME` sends
`x-session-id`): Talaria finds the session by the conversation's prefix.

Per call it prints the wall seconds the call took, the prompt's tokens, how many
of them the server reported as cached (the engine's own count), and the tool
the model called; at the end the session's completion time (SCT: first call
sent to last answer, wall seconds). On Talaria's sim engine the model is
synthetic: it calls one of the tools, with made-up arguments (the tool then
answers with an error, which the agent sends back like any result), and after
four tool results since the user last spoke it answers in text; this agent then
says "go on" and the loop goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TOOLS = [
    {"name": "list_files", "description": "List the files under a folder of the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "a folder"}},
                    "required": ["path"]}},
    {"name": "read_file", "description": "Read the first lines of a file of the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["path", "limit"]}},
    {"name": "search", "description": "Find the lines of the repository's files that contain a text.",
     "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}},
]
TASK = ("The test suite of this repository fails on a parser edge case. Find the parser, read it, "
        "and explain the bug. Use the tools; answer when you know.")


SKIPPED_FOLDERS = {"node_modules", "__pycache__", "site-packages", "venv", "build", "dist"}


class Tools:
    """The tools, confined to one folder."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def _path(self, rel: Any) -> Path:
        p = (self.root / str(rel)).resolve()
        if self.root not in (p, *p.parents):
            raise ValueError(f"{rel} is outside the repository")
        return p

    def _sources(self) -> list[Path]:
        """The repository's own .py files: hidden folders (a virtualenv, .git) and installed
        packages are skipped, as a coding agent's search skips them (walking a virtualenv
        with vLLM and torch took a search 14 s)."""
        found: list[Path] = []
        for folder, dirs, files in os.walk(self.root):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_FOLDERS)
            found += [Path(folder) / f for f in sorted(files) if f.endswith(".py")]
        return found

    def run(self, name: str, args: dict[str, Any]) -> str:
        try:
            if name == "list_files":
                p = self._path(args.get("path", "."))
                return "\n".join(sorted(x.name + ("/" if x.is_dir() else "") for x in p.iterdir())[:200])
            if name == "read_file":
                limit = max(1, min(int(args.get("limit", 40)), 400))
                return "".join(self._path(args["path"]).read_text(errors="replace").splitlines(True)[:limit])
            if name == "search":
                text, hits = str(args["text"]), []
                for f in self._sources()[:2000]:
                    for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                        if text in line:
                            hits.append(f"{f.relative_to(self.root)}:{i}: {line.strip()}")
                return "\n".join(hits[:50]) or "no match"
            return f"error: no tool named {name}"
        except (OSError, ValueError, KeyError) as exc:
            return f"error: {type(exc).__name__}: {exc}"


def record(a: argparse.Namespace, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
           usage: dict[str, Any]) -> None:
    """With --transcript: what this call sent and the usage it got, one JSON line a call."""
    if a.transcript:
        with open(a.transcript, "a") as f:
            f.write(json.dumps({"messages": messages, "tools": tools, "usage": usage}) + "\n")


def note_request(a: argparse.Namespace, reply: Any) -> None:
    """Keep the first reply's request id (the SDKs' `_request_id`, the gateway's
    `x-request-id`): `talaria logs` follows that call through the services by it."""
    if getattr(a, "first_request_id", None) is None:
        a.first_request_id = getattr(reply, "_request_id", None)


def openai_loop(a: argparse.Namespace, tools: Tools, headers: dict[str, str]) -> list[tuple[float, int, int, str]]:
    from openai import OpenAI

    client = OpenAI(base_url=a.base_url, api_key=a.api_key, default_headers=headers)
    offered = [{"type": "function", "function": t} for t in TOOLS]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful coding agent."},
                                      {"role": "user", "content": TASK}]
    rows = []
    for _ in range(a.calls):
        t0 = time.monotonic()
        r = client.chat.completions.create(model=a.model, messages=messages, tools=offered, max_tokens=a.max_tokens)
        wait = time.monotonic() - t0
        note_request(a, r)
        record(a, messages, offered, r.usage.model_dump())
        msg = r.choices[0].message
        details = r.usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details is not None else 0
        messages.append(msg.model_dump(exclude_none=True))
        called = [c.function.name for c in msg.tool_calls or []]
        for c in msg.tool_calls or []:
            try:
                args = json.loads(c.function.arguments)
            except ValueError:
                args = {}
            messages.append({"role": "tool", "tool_call_id": c.id, "content": tools.run(c.function.name, args)})
        rows.append((wait, r.usage.prompt_tokens, cached, ",".join(called) or "(answered)"))
        if not called:
            messages.append({"role": "user", "content": "Go on: check it with the tools."})
    return rows


def anthropic_loop(a: argparse.Namespace, tools: Tools, headers: dict[str, str]) -> list[tuple[float, int, int, str]]:
    import anthropic

    client = anthropic.Anthropic(base_url=a.base_url.removesuffix("/v1"), api_key=a.api_key, default_headers=headers)
    offered = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS]
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    rows = []
    for _ in range(a.calls):
        t0 = time.monotonic()
        m = client.messages.create(model=a.model, system="You are a careful coding agent.", messages=messages,
                                   tools=offered, max_tokens=a.max_tokens)
        wait = time.monotonic() - t0
        note_request(a, m)
        record(a, messages, offered, m.usage.model_dump())
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        uses = [b for b in m.content if b.type == "tool_use"]
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": tools.run(b.name, dict(b.input))} for b in uses]
        messages.append({"role": "user", "content": results or "Go on: check it with the tools."})
        prompt = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
        rows.append((wait, prompt, m.usage.cache_read_input_tokens or 0, ",".join(b.name for b in uses) or "(answered)"))
    return rows


def responses_loop(a: argparse.Namespace, tools: Tools, headers: dict[str, str]) -> list[tuple[float, int, int, str]]:
    """The same loop on OpenAI's Responses API, as Codex calls it: the whole conversation
    as `input` items every turn (`store: false`), tool calls as `function_call` items."""
    from openai import OpenAI

    client = OpenAI(base_url=a.base_url, api_key=a.api_key, default_headers=headers)
    offered = [{"type": "function", **t} for t in TOOLS]
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": TASK}]}]
    rows = []
    for _ in range(a.calls):
        t0 = time.monotonic()
        r = client.responses.create(model=a.model, instructions="You are a careful coding agent.", input=items,
                                    tools=offered, max_output_tokens=a.max_tokens, store=False)
        wait = time.monotonic() - t0
        note_request(a, r)
        record(a, items, offered, r.usage.model_dump())
        items += [o.model_dump(exclude_none=True) for o in r.output]
        calls = [o for o in r.output if o.type == "function_call"]
        for c in calls:
            try:
                args = json.loads(c.arguments)
            except ValueError:
                args = {}
            items.append({"type": "function_call_output", "call_id": c.call_id, "output": tools.run(c.name, args)})
        if not calls:
            items.append({"type": "message", "role": "user", "content": "Go on: check it with the tools."})
        rows.append((wait, r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens,
                     ",".join(c.name for c in calls) or "(answered)"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--api", choices=("openai", "anthropic", "responses"), default="openai",
                   help="chat completions, Anthropic Messages, or OpenAI Responses (as Codex calls it)")
    p.add_argument("--credentials", default=".talaria/logs/up/credentials.json",
                   help="`talaria up`'s credentials file (base URL and key), used when --base-url is not given")
    p.add_argument("--base-url", help="the OpenAI-style base URL, ending in /v1 (default: OPENAI_BASE_URL, else the credentials file)")
    p.add_argument("--api-key", help="the API key (default: OPENAI_API_KEY, else the credentials file)")
    p.add_argument("--model", default="glm-4.5-air-fp8", help="the model to call (GET /v1/models lists them; "
                                                               "default glm-4.5-air-fp8)")
    p.add_argument("--calls", type=int, default=20, help="calls the agent makes (default 20)")
    p.add_argument("--max-tokens", type=int, default=512, help="output tokens at most per call (default 512)")
    p.add_argument("--session", help="name the session (x-session-id); by default none is sent")
    p.add_argument("--transcript", help="append each call's messages, tools and usage to this file (JSON lines)")
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the folder the tools work on")
    a = p.parse_args(argv)
    a.base_url = a.base_url or os.environ.get("OPENAI_BASE_URL")
    a.api_key = a.api_key or os.environ.get("OPENAI_API_KEY")
    if not (a.base_url and a.api_key):
        try:
            creds = json.loads(Path(a.credentials).read_text())
        except (OSError, ValueError) as exc:
            print(f"no endpoint: give --base-url and --api-key, or start `talaria up` ({exc})", file=sys.stderr)
            return 2
        a.base_url, a.api_key = a.base_url or creds["openai_base_url"], a.api_key or creds["api_key"]
    headers = {"x-session-id": a.session} if a.session else {}
    t0 = time.monotonic()
    try:
        loop = {"openai": openai_loop, "anthropic": anthropic_loop, "responses": responses_loop}[a.api]
        rows = loop(a, Tools(Path(a.root)), headers)
    except Exception as exc:  # the SDK's own errors (status, type, message) say what went wrong
        print(f"the call failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    sct = time.monotonic() - t0
    print(f"{'call':>4} {'wait s':>7} {'prompt':>7} {'cached':>7} {'cached %':>8}  tool")
    for i, (wait, prompt, cached, tool) in enumerate(rows, 1):
        print(f"{i:>4} {wait:>7.2f} {prompt:>7} {cached:>7} {100 * cached / max(prompt, 1):>7.0f}%  {tool}")
    later = rows[1:]
    share = sum(c for _, _, c, _ in later) / max(1, sum(p for _, p, _, _ in later))
    print(f"SCT {sct:.2f} s wall for {len(rows)} calls ({a.api} API, model {a.model}); "
          f"cached {100 * share:.0f}% of the later calls' prompts")
    if getattr(a, "first_request_id", None):
        print(f"follow the first call through the services: talaria logs {a.first_request_id} "
              f"(--log-dir the stack's log folder)" + (f"; the session: talaria logs {a.session}" if a.session else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
