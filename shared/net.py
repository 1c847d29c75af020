"""Loopback addresses and free ports, for the embedded stack and a real engine's side channels;
how NATS clients tell a live server from a stopped one."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"
# A NATS server that stops answering (a stopped process, a partition that drops packets) keeps its
# TCP connections open: only unanswered PINGs tell, and nats-py's defaults (every 2 minutes, 2
# outstanding) took minutes, every call waiting meanwhile. At these, about 10 s, then the client
# reconnects to another node of the cluster.
NATS_PING_INTERVAL_S = 3
NATS_MAX_OUTSTANDING_PINGS = 3


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the usual bind-to-0 trick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])
