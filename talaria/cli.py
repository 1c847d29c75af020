"""The `talaria` command: sim, replay, up, status, study, fidelity, chaos, compare, paired, bound, bench-sim, bench-gateway, bench-tenants, demo, bench-vllm, logs, generate."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from shared.auth import nats_password_from_env, role_password_var
from shared.catalog import CatalogError, check_fit, load_catalog
from shared.policy import PRESETS, PolicyError, parse_policy, resolve_policy
from shared.settings import GATEWAY_DRAIN_WALL_S, parse_api_keys
from talaria.workload.trace import TraceError, TraceSession, load_runnable_trace
from talaria.workload import generate as gen
from talaria.argtypes import (
    SPEED_SCALE_RANGE, OutputError, model_seconds, output_file, output_folder, port_number, positive_float, positive_int,
    server_count, speed_scale,
)
from talaria.client import AgentLogin, Deployment
from talaria.results.report import add_speedups, format_table, oracle_sct, slowest_sessions, summarize
from talaria.workload.agent import DEFAULT_MAX_TOKENS
from talaria.ops.stack import (DEFAULT_MODELS, EmbeddedStack, LogDirInUse, StackSpec, StackStartError, default_log_dir,
                               local_fleet_problem)

if TYPE_CHECKING:
    from talaria.replay import Progress, ReplayOutcome

REPLAY_TIME_SCALE = 50.0  # an embedded replay's default: model seconds per wall second
# `talaria up`'s front-door key where it is set (else a fresh one at every start): the variable
# docs/front-door.md has Codex read its key from
API_KEY_VAR = "TALARIA_API_KEY"
API_KEYS_VAR = "TALARIA_API_KEYS"


def _fail(msg: str, code: int = 2) -> int:
    print(f"talaria: error: {msg}", file=sys.stderr)
    return code


def _policies(arg: str) -> list:
    names = [p.strip() for p in arg.split(",") if p.strip()]
    if not names:  # `--policy ,` printed an empty table and exited 0
        raise PolicyError(f"--policy {arg!r} names no policy (one or more of {', '.join(PRESETS)}, comma-separated)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # the same row run again only costs the time of its run
        raise PolicyError(f"--policy {arg!r} names {', '.join(twice)} more than once")
    return [resolve_policy(n) for n in names]


def _load(path: str) -> list[TraceSession]:
    sessions = load_runnable_trace(path, load_catalog())
    long = sum(1 for s in sessions for c in s.calls if c.output_tokens > DEFAULT_MAX_TOKENS)
    if long:  # (what the agents ask for; the trace is not wrong, but its figure is not what runs)
        print(f"talaria: note: {long} call{'s' if long > 1 else ''} of {path} write{'' if long > 1 else 's'} more "
              f"than {DEFAULT_MAX_TOKENS} tokens; each stops there, at the max_tokens the agents ask for "
              "(docs/trace-format.md)", file=sys.stderr)
    return sessions


def _models_of(sessions: list[TraceSession]) -> list[str]:
    return sorted({s.model for s in sessions})


def live_utilisation(out: ReplayOutcome, servers: int) -> dict[str, float]:
    """The share of the run (until its last session ends) each server had a call
    running, from the sim engine-workers' busy time mirrored in Redis; as the
    simulator reports it. Empty where no worker reported one (a real engine, or
    a replay against a deployment without its Redis)."""
    busy = sum(v for k, v in out.server_stats.items() if k.startswith("busy_s_"))
    horizon = max((r.finished_at for r in out.records), default=0.0)
    return {"utilisation": busy / (horizon * servers)} if busy and horizon else {}


def _print_results(runs: list[dict]) -> None:
    add_speedups(runs)
    print()
    print(format_table(runs))
    for r in runs:
        slow = ", ".join(f"{sid} {v:.0f}s" for sid, v in slowest_sessions(r, 3))
        busy = f"; servers busy {r['utilisation']:.0%} of the run" if "utilisation" in r else ""
        waits = ("not measured (an HTTP reply carries no waits)" if r["max_wait_s_by_model"] is None else
                 ", ".join(f"{m} {w:.0f}s" for m, w in r["max_wait_s_by_model"].items()))
        print(f"  {r['policy']}: slowest sessions {slow}; longest wait for a slot by model {waits}{busy}")


# -- sim ---------------------------------------------------------------------------
def cmd_sim(a: argparse.Namespace) -> int:
    from talaria.replay import write_json
    from talaria.workload.scenarios import sim_summary
    from talaria.sim.simulator import simulate

    policy_arg = "baseline" if a.policy is None else a.policy  # (`--policy ''` ran the baseline)
    max_tokens = DEFAULT_MAX_TOKENS
    if a.trace.endswith(".toml"):  # a scenario file (scenarios/*.toml): its trace (first seed), servers and policies
        from talaria.workload.scenarios import ScenarioError, load_scenario, scenario_catalog, trace_of

        try:
            sc = load_scenario(a.trace)
        except ScenarioError as exc:
            return _fail(str(exc))
        # a flag the scenario fixes otherwise is refused: silently overriding it printed another setting's figures
        for flag, given, own in (("--servers", a.servers, sc.servers),
                                 ("--server-profile", a.server_profile, sc.server_profile)):
            if given is not None and given != own:
                return _fail(f"{flag} {given}: the scenario {a.trace} sets {own} (edit the scenario, or leave {flag} out)")
        sessions = trace_of(sc, sc.seeds[0])
        a.servers, a.server_profile = sc.servers, sc.server_profile
        policy_arg = ",".join(sc.policies) if a.policy is None else a.policy
        catalog, max_tokens = scenario_catalog(sc), sc.max_tokens
    else:
        a.servers = 1 if a.servers is None else a.servers
        a.server_profile = "h100x8" if a.server_profile is None else a.server_profile
        sessions = _load(a.trace)
        catalog = load_catalog()
    policies = _policies(policy_arg)
    oracle = oracle_sct(sessions, catalog, a.server_profile, max_tokens)
    runs = []
    records = {}
    total_wall = 0.0
    for pol in policies:
        r = simulate(sessions, catalog, pol, servers=a.servers, server_profile=a.server_profile, max_tokens=max_tokens,
                     switch_cost_scale=a.switch_cost_scale, prefill_speed_scale=a.prefill_speed_scale,
                     call_latency_s=a.call_latency, check_invariants=a.check)
        total_wall += r.wall_s
        run = sim_summary(pol.name, sessions, r, oracle)
        runs.append(run)
        records[pol.name] = r.records
        print(f"[{pol.name}] simulated {run['calls_completed']}/{run['calls_total']} calls in {r.wall_s:.2f} s wall", file=sys.stderr)
    _print_results(runs)
    print(f"({total_wall:.2f} s of wall time)")
    # the results before the figures: a figure that cannot be written must not lose them
    if a.out:
        write_json(a.out, {"trace": a.trace, "engine": "sim", "servers": a.servers, "server_profile": a.server_profile,
                           "oracle": {"sct_p50_s": runs[0]["oracle_p50_s"], "sct_p95_s": runs[0]["oracle_p95_s"]},
                           "wall_s": total_wall, "runs": runs})
        print(f"results written to {a.out}")
    if a.plots:
        _write_plots(runs, records, a.plots)
    return 0


def _write_plots(runs: list[dict], records: dict, folder: str) -> None:
    from talaria.results.plots import write_plots

    try:
        paths = write_plots(runs, records, folder)
    except OSError as exc:  # (checked before the run; a disk that fills since is still one line)
        raise OutputError(f"cannot write the figures into {folder}: {exc.strerror or exc}") from None
    for path in paths:
        print(f"figure written to {path}")


# -- replay ------------------------------------------------------------------------
def new_run_dir(root: Path) -> Path:
    """A fresh folder under `root` for one run: its start time, then a random tag
    (two runs started in the same second still get their own)."""
    import time
    import uuid

    return root / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def _deployment(a: argparse.Namespace) -> Deployment | None:
    """The running deployment `replay` is pointed at (--credentials, --nats), or
    None for an embedded stack. Flags given explicitly win over the file."""
    if not a.credentials and not a.nats:
        return None
    dep = Deployment.load(a.credentials) if a.credentials else Deployment(nats_urls=a.nats.split(","))
    given: dict[str, object] = {"nats_urls": a.nats.split(",") if a.nats else None, "subject_prefix": a.subject_prefix,
                                "redis_url": a.redis, "key_prefix": a.key_prefix}
    if a.nats_user:
        password = nats_password_from_env(a.nats_user, dict(os.environ))
        if password is None:  # say which variable, rather than let the server refuse an empty login
            raise ValueError(f"--nats-user {a.nats_user}: no password: set {role_password_var(a.nats_user)} "
                             f"(or TALARIA_NATS_PASSWORD) in the environment")
        given["agent"] = AgentLogin(user=a.nats_user, password=password)
    return msgspec.structs.replace(dep, **{k: v for k, v in given.items() if v is not None})


def _wall_words(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:,.0f} days"


def replay_span_note(sessions: list[TraceSession], oracle: dict[str, float], time_scale: float, runs: int) -> str:
    """How long a replay takes at the least: its last session cannot end before its
    arrival plus its own work alone (a trace spread over days at a time scale of 50
    had sat at its first calls with no word of how long it would take)."""
    span = max((s.arrival_s + oracle[s.session_id] for s in sessions), default=0.0)
    each = span / time_scale
    total = f"; {_wall_words(each * runs)} for the {runs} policies" if runs > 1 else ""
    return (f"the trace's last session ends no sooner than {span:,.0f} model s: at least {_wall_words(each)} "
            f"of wall time a policy at --time-scale {time_scale:g}{total}")


def cmd_replay(a: argparse.Namespace) -> int:
    from talaria.replay import Progress, ReplayTargetError, replay_embedded, replay_external

    sessions = _load(a.trace)
    # checked before a stack starts: a bad name later in the list had the first policy replayed for nothing
    policies = _policies("baseline" if a.policy is None else a.policy)  # (`--policy ''` ran the baseline)
    catalog = load_catalog()
    oracle = oracle_sct(sessions, catalog, a.server_profile)
    outcomes: list[ReplayOutcome] = []
    try:
        target = _deployment(a)
    except ValueError as exc:  # an unreadable or malformed credentials file
        return _fail(str(exc))
    if target is not None and a.via_gateway:
        return _fail("--via-gateway replays through the embedded stack's gateway; against a running deployment, "
                     "point an agent at its gateway (docs/front-door.md)")
    if target is not None and a.policy is not None:
        # a running deployment replays under its own policy and time scale (it reports both)
        return _fail("--policy chooses the embedded stack's policy; a running deployment uses its own")
    # the embedded stack's own settings: a running deployment has its own (each was dropped unsaid)
    embedded_only = [flag for flag, given in (
        ("--servers", a.servers != 1), ("--routers", a.routers != 1), ("--time-scale", a.time_scale != REPLAY_TIME_SCALE),
        ("--switch-cost-scale", a.switch_cost_scale != 1.0), ("--prefill-speed-scale", a.prefill_speed_scale != 1.0))
        if given]
    if target is not None and embedded_only:
        return _fail(f"{', '.join(embedded_only)} set the embedded stack; a running deployment has its own "
                     "(`talaria up --time-scale 50 --servers 2 ...` starts one so)")
    deployment_only = [flag for flag, given in (
        ("--nats-user", a.nats_user), ("--redis", a.redis), ("--subject-prefix", a.subject_prefix),
        ("--key-prefix", a.key_prefix)) if given]
    if target is None and deployment_only:
        return _fail(f"{', '.join(deployment_only)} name a running deployment: give its --nats or --credentials too")
    if target is None:
        try:  # before the run: a log folder that cannot be made crashed the stack's start
            output_folder(a.log_dir)
        except argparse.ArgumentTypeError as exc:
            return _fail(f"--log-dir: {exc}")
        if (too_many := local_fleet_problem(a.servers, len(_models_of(sessions)), a.routers)):
            return _fail(too_many)
    calls = sum(len(s.calls) for s in sessions)
    progress = Progress("the deployment's policy", calls, len(sessions))
    run_dir: Path | None = None
    try:
        if target is not None:
            try:
                outcomes.append(asyncio.run(replay_external(sessions, target, progress)))
            except ReplayTargetError as exc:
                return _fail(str(exc))
        else:
            # one folder per run (a policy's logs under it): two replays never append to the same files
            run_dir = new_run_dir(Path(a.log_dir))
            print(f"logs of this run in {run_dir}", file=sys.stderr, flush=True)
            print(replay_span_note(sessions, oracle, a.time_scale, len(policies)), file=sys.stderr, flush=True)
            for pol in policies:
                progress = Progress(pol.name, calls, len(sessions))
                spec = StackSpec(policy=pol, models=_models_of(sessions), servers=a.servers, routers=a.routers,
                                 server_profile=a.server_profile, time_scale=a.time_scale, log_dir=run_dir / pol.name,
                                 switch_cost_scale=a.switch_cost_scale, prefill_speed_scale=a.prefill_speed_scale)
                outcomes.append(asyncio.run(replay_embedded(sessions, pol, spec, via_gateway=a.via_gateway,
                                                            progress=progress)))
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM, SIGHUP: the stack has stopped; say where the run was
        _interrupted(a, sessions, oracle, outcomes, progress, run_dir)
        raise
    runs, lag_bad = _replay_runs(a, sessions, oracle, outcomes)
    _print_results(runs)
    # the results before the figures: a figure that cannot be written must not lose them
    if a.out:
        _write_replay_json(a, runs, outcomes, run_dir)
        print(f"results written to {a.out}")
    if a.plots:
        _write_plots(runs, {o.policy: o.records for o in outcomes}, a.plots)
    for r, out in zip(runs, outcomes):
        print(f"  {r['policy']}: worst event-loop lag {r['worst_loop_lag_model_s']:.3f} model s ({r['worst_loop_lag_service']}); "
              f"stalled {100 * r['loop_stalled_share']:.2f}% of the run, summed over processes")
        if not out.services_lag_read:  # a running deployment's lag and counters live in its Redis
            print(f"  {r['policy']}: the services' event-loop lag and scheduler counters not read (pass the deployment's --redis)")
        if out.log_dir:
            print(f"  {r['policy']}: logs in {out.log_dir} (talaria logs SESSION --log-dir {out.log_dir})")
        if out.session_prefix:
            # (`talaria up` writes its credentials in its log folder)
            folder = Path(a.credentials).parent if getattr(a, "credentials", None) else "<the deployment's log folder>"
            print(f"  {r['policy']}: session ids prefixed {out.session_prefix}- "
                  f"(talaria logs SESSION --run {out.session_prefix} --log-dir {folder})")
    failed = [f for o in outcomes for f in o.failures]
    if failed:
        for f in failed[:10]:
            print(f"  failed: {f}", file=sys.stderr)
        return _fail(f"{len(failed)} sessions did not complete", 1)
    if lag_bad:
        return _fail("event-loop lag would distort the result (lower --time-scale): " + "; ".join(lag_bad), 3)
    return 0


def _replay_runs(a: argparse.Namespace, sessions: list[TraceSession], oracle: dict[str, float],
                 outcomes: list[ReplayOutcome]) -> tuple[list[dict], list[str]]:
    """The replayed policies as runs of the results JSON, and the lag that distorted any."""
    runs = []
    lag_bad = []
    for out in outcomes:
        run = summarize(out.policy, sessions, out.sct, out.records, oracle, extra={
            "wall_s": out.wall_s, "time_scale": out.time_scale or a.time_scale, "failures": out.failures,
            "calls_duplicated": out.duplicates, "worst_loop_lag_model_s": out.worst_lag_model_s,
            "worst_loop_lag_service": out.worst_lag_service, "loop_stalled_share": out.stalled_share,
            "loop_stalled_wall_s": out.stalled_wall_s,
            **({"log_dir": out.log_dir} if out.log_dir else {}),
            **({"session_prefix": out.session_prefix} if out.session_prefix else {}),
            "switches": int(out.server_stats.get("switches", 0)), "sp_admits": int(out.server_stats.get("sp_admits", 0)),
            "reservations": {k: out.server_stats.get(k, 0) for k in ("reservations_made", "reservations_hit", "reservations_expired", "reserved_idle_s")},
            **live_utilisation(out, out.servers or a.servers),  # (a deployment's own count, not --servers)
        })
        if a.via_gateway:
            # an HTTP reply carries no waits, prefix sources or timings: not measured, not zero
            run.update(calls_reprefilled=None, reprefill_tokens=None, round_waits=None, kv_tokens_restored=None,
                       time_breakdown_s=None, max_wait_s_by_model=None)
        runs.append(run)
        lag_bad += distorting_lag(out, run["sct_p50_s"], a.max_lag_s, a.max_stalled_share)
    return runs, lag_bad


STALL_SHARE_OF_P50 = 0.01  # --max-lag-s's default: one stall of 1% of the median SCT (5 model s at least)
MIN_MAX_LAG_MODEL_S = 5.0


def distorting_lag(out: ReplayOutcome, sct_p50_s: float, max_lag_s: float | None, max_stalled_share: float) -> list[str]:
    """Why a run's event-loop lag may have distorted its SCTs (none: it did not).
    One stall delays a session by at most its own length, so one of under 1% of the
    median SCT moves the median by under 1%; stalls that add up are judged by their
    share of the run (`ReplayOutcome.stalled_share`), once they add up to more than one
    stall may be (no session is delayed by more than all of them together: a short run's
    few 10-ms pauses were over 1% of its 1.7 s and failed it)."""
    limit = max_lag_s if max_lag_s is not None else max(MIN_MAX_LAG_MODEL_S, STALL_SHARE_OF_P50 * sct_p50_s)
    bad = []
    if out.worst_lag_model_s > limit:
        bad.append(f"{out.policy}: {out.worst_lag_service} lagged {out.worst_lag_model_s:.2f} model s at once "
                   f"(over {limit:.2f})")
    within_one_stall = out.time_scale > 0 and sum(out.stalled_wall_s.values()) * out.time_scale <= limit
    if out.stalled_share > max_stalled_share and not within_one_stall:
        most = max(out.stalled_wall_s.items(), key=lambda kv: kv[1])
        bad.append(f"{out.policy}: the processes stalled {100 * out.stalled_share:.2f}% of the run "
                   f"(over {100 * max_stalled_share:g}%; most: {most[0]}, {most[1]:.2f} wall s)")
    return bad


def _write_replay_json(a: argparse.Namespace, runs: list[dict], outcomes: list[ReplayOutcome], run_dir: Path | None,
                       **extra: object) -> None:
    from talaria.replay import write_json

    where = {"log_dir": str(run_dir)} if run_dir is not None else {"session_prefix": outcomes[0].session_prefix}
    servers = next((o.servers for o in outcomes if o.servers), a.servers)  # (a deployment's own count)
    write_json(a.out, {"trace": a.trace, "engine": "sim", "servers": servers, "server_profile": a.server_profile,
                       "oracle": {"sct_p50_s": runs[0]["oracle_p50_s"], "sct_p95_s": runs[0]["oracle_p95_s"]},
                       **where, **extra, "runs": runs})


def _interrupted(a: argparse.Namespace, sessions: list[TraceSession], oracle: dict[str, float],
                 outcomes: list[ReplayOutcome], progress: Progress, run_dir: Path | None) -> None:
    """One line for a replay stopped by a signal (it printed nothing): the policies that
    completed, how far the current one got, and the completed ones' results in --out,
    marked partial (an hour's run is not all lost to a late Ctrl-C)."""
    done = [o.policy for o in outcomes]
    msg = (f"talaria: replay interrupted: completed {', '.join(done) or 'no policy'}; "
           f"{progress.policy} had {progress.calls_done} of {progress.total_calls} calls answered")
    if done:  # the completed policies' table, as a whole run prints it
        runs, _ = _replay_runs(a, sessions, oracle, outcomes)
        add_speedups(runs)
        _print_results(runs)
    if done and a.out:
        try:
            _write_replay_json(a, runs, outcomes, run_dir, partial={
                "completed": done, "interrupted": progress.policy, "calls_answered": progress.calls_done})
            msg += f"; the completed results written to {a.out} (marked partial)"
        except OutputError as exc:
            msg += f"; {exc}"
    elif a.out:
        msg += f"; nothing written to {a.out} (no policy completed)"
    print(msg, file=sys.stderr, flush=True)


# -- up ------------------------------------------------------------------------------
def cmd_up(a: argparse.Namespace) -> int:
    # refuse a bad model or profile here, not as services that fail their health checks
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    if not models:
        return _fail("--models names no model")
    twice = sorted({m for m in models if models.count(m) > 1})
    if twice:  # (each model is one engine-worker per server: it ended in a traceback)
        return _fail(f"--models names {', '.join(twice)} more than once")
    catalog = load_catalog()  # (TALARIA_CATALOG's, as the services read it)
    # the models' weights and contexts fit the server: else its substrate failed at every start
    check_fit(catalog.server(a.server_profile), [catalog.model(m) for m in models])
    policy = parse_policy(a.policy)
    if a.no_gateway and a.gateway_port:
        return _fail("--gateway-port names the port of the gateway that --no-gateway leaves out")
    more_keys = os.environ.get(API_KEYS_VAR, "")  # further tenants, as compose's env file gives them
    try:
        tenants = set(parse_api_keys(more_keys).values())
    except ValueError as exc:
        return _fail(f"{API_KEYS_VAR}: {exc}")

    async def run() -> None:
        spec = StackSpec(policy=policy, models=models, servers=a.servers, liveness=True, supervise_stores=True,
                         routers=a.routers, server_profile=a.server_profile, time_scale=a.time_scale, log_dir=Path(a.log_dir),
                         nats_urls=a.nats.split(",") if a.nats else None, redis_url=a.redis,
                         subject_prefix=a.subject_prefix, key_prefix=a.key_prefix, gateway=not a.no_gateway,
                         gateway_port=a.gateway_port or 0, api_key=os.environ.get(API_KEY_VAR) or None,
                         more_api_keys=more_keys)
        stack = EmbeddedStack(spec)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, stop.set)
        cred_file = Path(a.log_dir) / "credentials.json"
        stack.check_before_start()  # (a port in use, vLLM not installed: refused before anything starts)
        stack.claim_log_dir()  # (refused before anything is said or started when another stack runs from it)
        try:
            started = [name for name, external in (("NATS", a.nats), ("Redis", a.redis)) if not external]
            print(f"starting {', '.join(started) + ' and ' if started else ''}the services: policy {policy.name}, time scale "
                  f"{a.time_scale:g}x, logs in {spec.log_dir} ...", flush=True)
            # Ctrl-C while it starts stops it then, not once the start has waited out its health checks
            starting = asyncio.ensure_future(stack.start())
            asked_to_stop = asyncio.ensure_future(stop.wait())
            await asyncio.wait({starting, asked_to_stop}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
                return
            asked_to_stop.cancel()
            starting.result()  # (its error, if it failed)
            dep = stack.deployment()
            if stack.creds is not None:  # `talaria status` checks health as the operator role
                dep = msgspec.structs.replace(dep, operator=AgentLogin(**stack.nats_auth("operator")))
            dep.write(cred_file)
            if stack.creds is not None:
                print(f"authentication on: agent credentials (NATS user 'agent') in {cred_file}")
            print(f"replay against it: talaria replay TRACE --credentials {cred_file}")
            # (its data in a folder of this stack's, and not on 9090, often a system Prometheus's port)
            print(f"metrics: prometheus --config.file={stack.prometheus_config} "
                  f"--storage.tsdb.path={stack.log_dir / 'prometheus-data'} --web.listen-address=127.0.0.1:9091  "
                  "(docs/observability.md)")
            if stack.openai_base_url:
                # the key is in the credentials file (mode 600), not on the terminal
                print(f"HTTP front door: OPENAI_BASE_URL={stack.openai_base_url}  ANTHROPIC_BASE_URL={stack.gateway_url}\n"
                      f"  its API key is `api_key` in {cred_file} (docs/front-door.md)"
                      + (f"; also the keys of {API_KEYS_VAR} ({', '.join(sorted(tenants))})" if tenants else ""))
            print(f"talaria is up: NATS {','.join(stack.nats_urls)}\n"
                  f"  subject prefix {stack.subject_prefix}  key prefix {stack.key_prefix}  policy {spec.policy.name}  "
                  f"time scale {spec.time_scale:g}x\n  logs in {stack.log_dir}; Ctrl-C stops everything", flush=True)
            await stop.wait()
        finally:
            ours = stack.holds_log_dir
            if ours:  # (else another stack runs from it: its files are not this one's)
                stack.mark_stopping()  # (`talaria status` says so, not "still starting")
                print(f"stopping: calls in flight may finish (up to {GATEWAY_DRAIN_WALL_S:g} s; Ctrl-C again "
                      "ends them now) ...", flush=True)
                # its passwords die with the stack: a stale file would only mislead `replay --credentials`
                cred_file.unlink(missing_ok=True)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.add_signal_handler(sig, stack.cut_drain)
            await stack.stop()
            if ours:
                print("stopped: every process of the stack has ended", flush=True)

    asyncio.run(run())
    return 0


def _version() -> str:
    """From the installed package's metadata (pyproject.toml), not a second copy in code."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("talaria")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="talaria", description="Serve large LLMs to tool-using agents (see README.md)")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                   help="print the installed version and exit")
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--servers", type=server_count, default=1, help="number of servers (default 1)")
        sp.add_argument("--server-profile", default="h100x8", help="server profile from the catalog (default h100x8)")
        sp.add_argument("--switch-cost-scale", type=positive_float, default=1.0, help="sensitivity: scale model-switch costs")
        sp.add_argument("--prefill-speed-scale", type=speed_scale, default=1.0,
                        help=f"sensitivity: scale prefill speed ({SPEED_SCALE_RANGE[0]:g}..{SPEED_SCALE_RANGE[1]:g}; "
                             "default 1, the catalog's)")

    s = sub.add_parser("sim", help="simulate policies on a trace on a virtual clock (same policy code)")
    s.add_argument("trace", help="a trace (JSONL), or a scenario file (scenarios/*.toml: its first seed, catalog, "
                                 "max_tokens, servers, server profile and policies; --servers and --server-profile "
                                 "must agree with it)")
    s.add_argument("--policy", default=None, help=f"comma-separated: {', '.join(PRESETS)}, or PEER@baseline "
                                                  "(default: baseline; a scenario's policies for a scenario)")
    s.add_argument("--out", type=output_file, help="write results JSON here")
    s.add_argument("--check", action="store_true", help="check memory and KV bounds at every event")
    s.add_argument("--plots", type=output_folder, help="write PNG figures (SCT distribution, slowest-session timelines) into this folder")
    s.add_argument("--call-latency", type=model_seconds, default=0.0, metavar="S",
                   help="sensitivity: model seconds between a reply and the session's next call reaching admission, "
                        "beyond the tool gap (the control plane's hops; a live replay at --time-scale 50 measures "
                        "about 0.1-0.2 here, docs/results.md); default 0, at most 1e9")
    common(s)
    # None: not given, so a scenario's own servers and profile apply (cmd_sim: 1 and h100x8 for a trace)
    s.set_defaults(fn=cmd_sim, servers=None, server_profile=None)

    r = sub.add_parser("replay", help="replay a trace's agents through the live services over NATS")
    r.add_argument("trace", help="the trace to replay (JSON Lines, docs/trace-format.md)")
    r.add_argument("--policy", default=None, help=f"comma-separated: {', '.join(PRESETS)} (default baseline; "
                                                  "the embedded stack only)")
    r.add_argument("--time-scale", type=positive_float, default=REPLAY_TIME_SCALE,
                   help=f"model seconds per wall second (default {REPLAY_TIME_SCALE:g}; the embedded stack only: a "
                        "running deployment replays at its own)")
    r.add_argument("--out", type=output_file, help="write results JSON here")
    r.add_argument("--plots", type=output_folder, help="write PNG figures (SCT distribution, slowest-session timelines) into this folder")
    r.add_argument("--credentials", metavar="FILE",
                   help="replay against a running deployment: the credentials file `talaria up` writes "
                        "(its NATS URLs, subject prefix, agent login, Redis)")
    r.add_argument("--nats", help="replay against a running deployment at these NATS URLs (comma-separated)")
    r.add_argument("--nats-user", help="with --nats: log in as this NATS user (a compose deployment's agents: agent); "
                                       "the password from TALARIA_NATS_PASSWORD or TALARIA_NATS_PASSWORD_<USER>")
    r.add_argument("--redis", help="with --nats: the deployment's Redis, to read its loop-lag reports "
                                   "(redis://host:port/db, or redis+sentinel://host:port,.../<master name>)")
    r.add_argument("--subject-prefix", default=None, help="a running deployment's subject prefix (default talaria)")
    r.add_argument("--key-prefix", default=None, help="a running deployment's Redis key prefix (default talaria:)")
    r.add_argument("--log-dir", default=str(default_log_dir()),
                   help=f"where each run gets a folder of its own for the services' logs (default {default_log_dir()})")
    r.add_argument("--max-lag-s", type=positive_float, default=None, help="exit 3 when one event-loop lag of a service or of this replay exceeds this many model seconds (default: 1%% of the policy's p50 SCT, at least 5; lower --time-scale then)")
    r.add_argument("--max-stalled-share", type=positive_float, default=0.01, help="exit 3 when the event loops' stalls (lags of 10 ms or more), summed over the processes, exceed this share of the run's wall time (default 0.01) and, together, what one stall may take (--max-lag-s)")
    r.add_argument("--routers", type=positive_int, default=1, help="router replicas in the embedded stack (default 1)")
    r.add_argument("--via-gateway", action="store_true",
                   help="the agents call the embedded stack's HTTP gateway (OpenAI chat completions, a session "
                        "header, the trace's output lengths through the talaria extension field) instead of NATS")
    common(r)
    r.set_defaults(fn=cmd_replay)

    u = sub.add_parser("up", help="bring up NATS, Redis, every service and the HTTP front door for agents; Ctrl-C stops everything")
    u.add_argument("--policy", default="talaria",  # what it serves with, as compose's defaults do
                   help=f"the policy every service runs (default talaria; one of {', '.join(PRESETS)}), or a "
                        "preset with fields changed, e.g. talaria:slot_s=300 (docs/scheduler.md)")
    u.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma-separated catalog models to serve, one engine-worker each per server "
                        f"(default {','.join(DEFAULT_MODELS)}; the catalog, shared/data/catalog.toml, has gpt-oss-120b and "
                        "llama-4-scout-fp8 too)")
    u.add_argument("--time-scale", type=positive_float, default=1.0,
                   help="model seconds per wall second (default 1: agents at the HTTP front door live in wall time)")
    u.add_argument("--no-gateway", action="store_true", help="do not start the HTTP gateway (the front door)")
    u.add_argument("--gateway-port", type=port_number, default=None,
                   help="the front door's port on 127.0.0.1 (default: a free one at every start); with the key from "
                        f"{API_KEY_VAR} an agent's base URL and key stay the same across restarts")
    u.add_argument("--nats", help="use this NATS (comma-separated URLs) instead of starting one")
    u.add_argument("--redis", help="use this Redis instead of starting one: redis://[user:pw@]host:port/db, or a "
                                   "Sentinel-watched master, redis+sentinel://[user:pw@]host:port,.../<master name> "
                                   "(docs/deploy.md)")
    u.add_argument("--subject-prefix", default=None, help="first token of every subject (default: a fresh one)")
    u.add_argument("--key-prefix", default=None, help="prefix of every Redis key (default: a fresh one)")
    u.add_argument("--log-dir", type=output_folder, default=str(default_log_dir() / "up"),
                   help=f"the services' logs and credentials.json (default {default_log_dir() / 'up'}, "
                        "apart from the replays' run folders; one running stack per folder)")
    u.add_argument("--servers", type=server_count, default=1, help="GPU servers to emulate (default 1)")
    u.add_argument("--routers", type=positive_int, default=1, help="router replicas (one queue group)")
    u.add_argument("--server-profile", default="h100x8", help="hardware profile from the catalog (default h100x8)")
    u.set_defaults(fn=cmd_up)

    ss = sub.add_parser("status", help="a running deployment's services, their health and each server's active model")
    from talaria.ops import status

    status.configure_parser(ss, default_log_dir() / "up" / "credentials.json")

    st = sub.add_parser("study", help="tune policies, seed spread, ablations and sensitivity on the simulator")
    from talaria.lab import experiments

    experiments.configure_parser(st)
    fd = sub.add_parser("fidelity", help="live replay against the simulator on generated traces (median differences)")
    experiments.configure_fidelity(fd)

    ch = sub.add_parser("chaos", help="replay a trace while killing and restarting every component on a seeded schedule")
    from talaria.lab import chaos

    chaos.configure_parser(ch)

    from talaria.workload import scenarios

    cp = sub.add_parser("compare", help="run every policy of a scenario file over its seeds on the simulator; print the table")
    scenarios.configure_compare(cp)
    from talaria.lab import paired

    pp = sub.add_parser("paired", help="every policy against Talaria on the same traces: median paired p50/p95 "
                        "differences over seeds with 95%% bootstrap intervals")
    paired.configure_paired(pp)
    bd = sub.add_parser("bound", help="a lower bound on mean and p50 SCT (one model at a time per server) "
                        "beside the baseline's and Talaria's figures")
    paired.configure_bound(bd)
    bp = sub.add_parser("bench-sim", help="time the simulator: the default trace (< 5 s) and ~100,000 calls (< 2 min)")
    scenarios.configure_bench(bp)
    from talaria.lab import gateway_bench

    bg = sub.add_parser("bench-gateway", help="the HTTP gateway's overhead over a direct NATS client (wall ms, p50/p99)")
    gateway_bench.configure_parser(bg, default_log_dir() / "bench-gateway")
    from talaria.lab import tenant_bench

    bt = sub.add_parser("bench-tenants", help="one tenant's call during another tenant's flood (wall s)")
    tenant_bench.configure_parser(bt, default_log_dir() / "bench-tenants")
    from talaria.lab import observability_bench

    bo = sub.add_parser("bench-observability", help="what tracing adds per call at 200 calls/s (wall ms, p50/p99)")
    observability_bench.configure_parser(bo, default_log_dir() / "bench-observability")
    from talaria.lab import control_plane_bench

    bc = sub.add_parser("bench-control-plane", help="the live stack's cost per call: calls served, added latency "
                                                    "(wall ms) and CPU per process kind at open-loop rates")
    control_plane_bench.configure_parser(bc, default_log_dir() / "bench-control-plane")
    from talaria.lab import gateway_fuzz

    fz = sub.add_parser("fuzz-gateway", help="malformed and hostile HTTP requests against the front door; "
                                             "exits 1 unless every refusal is typed and nothing else moved")
    gateway_fuzz.configure_parser(fz, default_log_dir() / "fuzz-gateway")

    from talaria.lab import vllm_bench  # imports vLLM only when its commands run

    vllm_bench.configure_parsers(sub)

    from talaria.ops import sessionlog

    lg = sub.add_parser("logs", help="one session's path through the services, merged from their logs")
    sessionlog.configure_parser(lg, default_log_dir())

    g = sub.add_parser("generate", help="generate a SWE-bench-like trace from a settings file")
    gen.configure_parser(g)
    g.set_defaults(fn=gen.run)
    return p


def _exit_on_signal(signum: int, _frame: object) -> None:
    # SIGTERM and SIGHUP would end the process without unwinding it: raise instead, so the
    # stacks' context managers and the process registry's atexit hook stop what we started
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():  # (a caller's thread keeps its own handlers)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _exit_on_signal)
    try:
        return int(args.fn(args) or 0)
    except (TraceError, CatalogError, PolicyError, OutputError, LogDirInUse, StackStartError) as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader left (`talaria status | head`): no traceback, and none at exit for the flush either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
