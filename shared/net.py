"""Loopback addresses and free ports, for the embedded stack and a real engine's side channels;
how NATS clients tell a live server from a stopped one."""

from __future__ import annotations

import random
import socket

LOOPBACK = "127.0.0.1"
# A NATS server that stops answering (a stopped process, a partition that drops packets) keeps its
# TCP connections open: only unanswered PINGs tell, and nats-py's defaults (every 2 minutes, 2
# outstanding) took minutes, every call waiting meanwhile. At these, about 10 s, then the client
# reconnects to another node of the cluster.
NATS_PING_INTERVAL_S = 3
NATS_MAX_OUTSTANDING_PINGS = 3
# nats-py's connect keywords for that keep-alive: every long-lived connection takes them
NATS_KEEPALIVE = {"ping_interval": NATS_PING_INTERVAL_S, "max_outstanding_pings": NATS_MAX_OUTSTANDING_PINGS}
# A stopped node still accepts TCP connections (the kernel's backlog) and never sends its INFO:
# a client whose first pick is that node moves to the next after this long.
NATS_CONNECT_TIMEOUT_S = 5.0
NO_RESPONDERS_STATUS = "503"  # NATS's status on a reply subject when nobody is subscribed to the request's subject


def no_responders(msg: object) -> bool:
    """Whether a message on a reply subject is NATS's own "no responders" status (empty
    data, a `Status: 503` header), not an answer from anyone."""
    headers = getattr(msg, "headers", None)
    return bool(headers) and headers.get("Status") == NO_RESPONDERS_STATUS  # type: ignore[union-attr]


LISTEN_PORTS_FROM = 20000  # the lowest port `free_port` hands out (below the kernel's ephemeral range)


def _ephemeral_low() -> int:
    """The lowest port the kernel gives a bind to port 0 or an outgoing connection."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def port_free(port: int, host: str = LOOPBACK, reuse_addr: bool = True) -> bool:
    """Whether a server could bind `port` on `host` right now (`reuse_addr`: as aiohttp
    binds, so a port in TIME_WAIT counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, for a server that binds it a moment
    later. Taken below the kernel's ephemeral range where there is room: a port from a
    bind to 0 goes back to that range, and a process binding port 0 meanwhile (a metrics
    endpoint) could be given it (seen: a gateway found its port taken by admission's
    metrics, twice in one CI run, and crash-looped)."""
    low = _ephemeral_low()
    if low - LISTEN_PORTS_FROM >= 1000:
        for port in random.sample(range(LISTEN_PORTS_FROM, low), 64):
            if port_free(port, reuse_addr=False):  # (any server may take it, not only one binding so)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])
