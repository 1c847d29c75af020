"""A lower bound on SCT with one model at a time per server (pure arithmetic, no I/O).

Two relaxations, each valid for any policy the simulator can run, combined:

- *alone*: a session is never faster than alone on a server with its model
  active and its prefix in HBM (`oracle_sct`), so SCT_i >= oracle_i;
- *capacity*: a server runs one model at a time and its engine prefills one
  call at a time with decode paused (the sim engine's rule), so every call
  costs the server at least its prefill (prefix cached) plus, per output
  token, its share of a decode step at the best batch its model could form
  (at most one call per session of that model) and its own KV read. This
  *work* adds up per server; S servers finish the k sessions that complete
  first no earlier than the first arrival + (the k smallest works) / S.

With C_(k) the k-th completion, both give C_(k) >= max(a_(1) + S_k / S,
k-th smallest of a_i + oracle_i); mean SCT >= (sum_k C_(k) - sum_i a_i) / n.
For the p50 (linear-interpolated, as reported) every SCT is at least its
oracle, so p50 >= p50 of the oracles; capacity adds: the j+1 sessions with
the smallest SCT (j = floor((n-1)/2), the lower of the middle pair) all end
by a_(n) + p50, so p50 >= a_(1) + S_{j+1} / S - a_(n).
Switches, KV restores and queueing are left out (>= 0), so the bound is
loose where they matter. All figures in model seconds of the cost model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shared.catalog import Catalog, ModelSpec
from shared.costmodel import CostModel
from talaria.results.report import percentile
from talaria.workload.agent import DEFAULT_MAX_TOKENS, plan_session
from talaria.workload.trace import TraceSession


@dataclass(frozen=True, slots=True)
class SctBound:
    mean_s: float          # lower bound on mean SCT
    p50_s: float           # lower bound on p50 SCT
    mean_alone_s: float    # the alone relaxation on its own (mean of the oracles)
    p50_alone_s: float
    mean_capacity_s: float  # the capacity relaxation on its own
    p50_capacity_s: float


def decode_token_share_s(cost: CostModel, model: ModelSpec, max_batch: int) -> float:
    """The least batch-wide decode time one output token can cost the server:
    a step of b calls takes base ITL(b) (plus each call's own KV read, counted
    apart), so per token min over b <= max_batch of ITL_base(b) * scale / b."""
    best = min(cost.base_itl_s(b) * model.decode_itl_scale / b for b in range(1, max(1, max_batch) + 1))
    return best / cost.decode_speed_scale


def call_work_s(cost: CostModel, model: ModelSpec, prompt: int, prefix: int, output: int, token_share_s: float) -> float:
    """Server time a call needs at least: its prefill over a cached prefix, and
    per output token the batch share plus the read of its own KV (its prompt's,
    a lower bound on the growing context)."""
    kv_read = (prompt * model.kv_bytes_per_token + model.kv_bytes_per_seq) / cost.server.gpus / (
        cost.server.hbm_tb_s_per_gpu * 1e12)
    # the prefill is least with the whole prefix reused (a restore or a shorter reuse only adds)
    return cost.prefill_s(model, prompt - prefix, prefix) + output * (token_share_s + kv_read / cost.decode_speed_scale)


def sct_lower_bound(arrivals: Sequence[float], oracle: Sequence[float], work: Sequence[float], servers: int = 1) -> SctBound:
    """Combine the two relaxations (module docstring) for n sessions given, per
    session, its arrival, its oracle SCT and its work (aligned sequences)."""
    n = len(arrivals)
    if n == 0 or not (len(oracle) == len(work) == n):
        raise ValueError("arrivals, oracle and work must be non-empty and of the same length")
    if servers < 1:
        raise ValueError("servers must be >= 1")
    a_first, a_last = min(arrivals), max(arrivals)
    done_alone = sorted(a + o for a, o in zip(arrivals, oracle))
    smallest = sorted(work)
    prefix_work = 0.0
    sum_cap = sum_both = 0.0
    for k in range(n):
        prefix_work += smallest[k]
        by_capacity = a_first + prefix_work / servers
        sum_cap += by_capacity
        sum_both += max(by_capacity, done_alone[k])
    total_arrival = math.fsum(arrivals)
    mean_alone = math.fsum(oracle) / n
    # alone it can fall below 0 (arrivals spread wider than the work): no SCT does, so clamp it, as the p50's
    mean_capacity = max(0.0, (sum_cap - total_arrival) / n)
    mean_both = max(mean_alone, (sum_both - total_arrival) / n)
    j = (n - 1) // 2
    p50_capacity = max(0.0, a_first + sum(smallest[: j + 1]) / servers - a_last)
    p50_alone = percentile(oracle, 50)
    return SctBound(mean_s=mean_both, p50_s=max(p50_alone, p50_capacity), mean_alone_s=mean_alone,
                    p50_alone_s=p50_alone, mean_capacity_s=mean_capacity, p50_capacity_s=p50_capacity)


def trace_bound(sessions: Sequence[TraceSession], catalog: Catalog, *, servers: int = 1,
                server_profile: str = "h100x8", max_tokens: int = DEFAULT_MAX_TOKENS) -> SctBound:
    """The bound for a trace: per session its arrival, its time alone (the
    oracle's sum, with outputs capped at what the call may ask for, as the
    simulator caps them) and its work on the server."""
    cost = CostModel(catalog, catalog.server(server_profile))
    per_model: dict[str, int] = {}
    for s in sessions:
        per_model[s.model] = per_model.get(s.model, 0) + 1
    arrivals: list[float] = []
    alone: list[float] = []
    work: list[float] = []
    for s in sessions:
        spec = catalog.model(s.model)
        share = decode_token_share_s(cost, spec, per_model[s.model])
        t_alone = t_work = 0.0
        for c in plan_session(s, max_tokens, context_limit=spec.context_limit):
            out = max(1, min(c.sim_stop_tokens, c.max_tokens))
            t_alone += cost.prefill_s(spec, c.prompt_tokens - c.prefix_tokens, c.prefix_tokens)
            t_alone += cost.decode_alone_s(spec, c.prompt_tokens, out) + c.tool_s
            t_work += call_work_s(cost, spec, c.prompt_tokens, c.prefix_tokens, out, share)
        arrivals.append(s.arrival_s)
        alone.append(t_alone)
        work.append(t_work)
    return sct_lower_bound(arrivals, alone, work, servers)
