"""Discovery for Prometheus: the embedded stack's scrape config and targets file.

`talaria up` (and every embedded stack) gives each service process a metrics
port of its own, fresh at every (re)start, and keeps `<log dir>/prometheus-targets.json`
(Prometheus's `file_sd` format) equal to what runs (empty once it stops); `<log dir>/prometheus.yml`
points at it, so `prometheus --config.file=<log dir>/prometheus.yml` scrapes the
stack as it is and follows a restarted process to its new port (Prometheus
re-reads the targets file on change). Pure rendering here; the stack writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TARGETS_FILE = "prometheus-targets.json"
CONFIG_FILE = "prometheus.yml"
SCRAPE_INTERVAL_S = 1  # a local stack: cheap, and short replays still get several scrapes


def service_kind(process: str) -> str:
    """`router-0` -> router, `engine-s0-glm-4.5-air-fp8` -> engine (the `service` label)."""
    return process.split("-", 1)[0]


def render_targets(ports: dict[str, int], host: str = "127.0.0.1") -> str:
    """One target group per process: its address, and labels `service` and `process`."""
    groups = [{"targets": [f"{host}:{port}"], "labels": {"service": service_kind(name), "process": name}}
              for name, port in sorted(ports.items())]
    return json.dumps(groups, indent=1) + "\n"


# the deployment's alerting rules (deploy/prometheus/alerts.yml), where this is a checkout
ALERT_RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"


def render_config(targets_path: Path, scrape_interval_s: float = SCRAPE_INTERVAL_S,
                  rule_files: tuple[Path, ...] = tuple(p for p in (ALERT_RULES,) if p.is_file())) -> str:
    rules = f"rule_files: [{', '.join(json.dumps(str(p)) for p in rule_files)}]\n" if rule_files else ""
    return (
        "# written by talaria's embedded stack; the targets file follows restarts\n"
        "global:\n"
        f"  scrape_interval: {scrape_interval_s:g}s\n"
        f"  evaluation_interval: {scrape_interval_s:g}s\n"
        + rules +
        "scrape_configs:\n"
        "  - job_name: talaria\n"
        "    file_sd_configs:\n"
        f"      - files: [{json.dumps(str(targets_path.resolve()))}]\n"
        f"        refresh_interval: {scrape_interval_s:g}s\n"
    )


def write_atomically(path: Path, text: str) -> None:
    """Prometheus may read the file at any moment: never a half-written one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
