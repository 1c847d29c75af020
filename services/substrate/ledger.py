"""The substrate's memory ledger and switch planner (pure; no I/O).

Owns, for one server: the HBM region plan (stable addresses: weights and KV
regions reserved once at start), the host DRAM tier (a pinned copy of every
model's weights plus session KV spilled at switch-out, evicted LRU), weight
staging (the next model's weights copied host->device into the weights
region's spare room ahead of its slot), and the cost of each switch.

Rules (docs/mechanisms.md states them for users):
- stable addresses on: regions are reserved once; a switch only remaps
  contents (`remap_s`); `region_reservations` stays 1 for the whole run.
  Off: every switch re-creates engine memory and CUDA graphs (`reinit_s`,
  from the published cold-start breakdown) and the regions are re-reserved.
- staging off (the baseline's vLLM sleep level 1 / wake): switch-out copies
  the old weights to host and pays the measured sleep residual; switch-in
  loads the new weights from host and pays the measured wake residual.
  Staging on: the host copy of the old weights is kept (switch-out discards),
  the staged part of the new weights moves device-to-device, the rest comes
  from host, and the wake residual is overlapped with the previous slot by
  the staging that began during it (whatever part it could not hide is paid).
- host-KV restore on: the old model's idle session KV is copied to host
  (only the part not already there) in parallel with the weight load, and
  restored per call at the engine; so is KV the active engine pushes out of
  HBM for room during a slot (`accept_spill`). Off: it is dropped.
- the host KV tier is bounded by host DRAM less every model's pinned weights;
  over it, least recently spilled sessions go first, the active model's last
  (the active engine's view of host KV is told what it lost).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from shared.costmodel import CostModel
from shared.catalog import ModelSpec, ServerProfile
from shared.policy import PolicyConfig


@dataclass(frozen=True, slots=True)
class RegionPlan:
    usable_bytes: float
    weights_region_bytes: float
    kv_region_bytes: float


@dataclass(frozen=True, slots=True)
class SwitchPlan:
    from_model: str | None
    to_model: str
    duration_s: float
    weights_out_s: float
    weights_in_s: float
    kv_out_s: float
    fixed_s: float
    staged_bytes: float
    kv_to_host_tokens: int
    kv_dropped_tokens: int
    kv_capacity_tokens: int
    host_kv_view: dict[str, int]


@dataclass(slots=True)
class _Staging:
    model: str
    nbytes: float
    started_at: float
    ready_at: float


def region_plan(server: ServerProfile, models: list[ModelSpec], policy: PolicyConfig, active: ModelSpec | None = None) -> RegionPlan:
    usable = server.usable_hbm_bytes
    if policy.stable_addresses or active is None:
        weights = max(m.weights_bytes for m in models)
    else:
        weights = active.weights_bytes
    return RegionPlan(usable_bytes=usable, weights_region_bytes=weights, kv_region_bytes=max(0.0, usable - weights))


def kv_capacity_tokens(server: ServerProfile, models: list[ModelSpec], policy: PolicyConfig, model: ModelSpec) -> int:
    plan = region_plan(server, models, policy, active=model)
    return int(plan.kv_region_bytes // model.kv_bytes_per_token)


@dataclass
class SubstrateLedger:
    server: ServerProfile
    models: dict[str, ModelSpec]
    cost: CostModel
    policy: PolicyConfig
    active: str | None = None
    region_reservations: int = 0
    host_kv: OrderedDict[tuple[str, str], int] = field(default_factory=OrderedDict)
    staging: _Staging | None = None
    switch_in: tuple[str, float] | None = None  # (model, model time its switch ends): moving into HBM now
    # counters for reports
    switches: int = 0
    kv_bytes_to_host: float = 0.0
    kv_bytes_dropped: float = 0.0
    kv_evicted_from_host: float = 0.0

    def __post_init__(self) -> None:
        self.plan = region_plan(self.server, list(self.models.values()), self.policy)
        weights_total = sum(m.weights_bytes for m in self.models.values())
        if self.plan.kv_region_bytes <= 0:
            raise ValueError(f"{self.server.name}: the largest model's weights leave no HBM for KV")
        if weights_total > self.server.host_bytes:
            raise ValueError(f"{self.server.name}: host DRAM cannot hold every model's weights")
        self.host_kv_capacity_bytes = self.server.host_bytes - weights_total
        self.region_reservations = 1  # reserved once, at start

    # -- views -------------------------------------------------------------------
    def kv_capacity_tokens(self, model: str) -> int:
        return kv_capacity_tokens(self.server, list(self.models.values()), self.policy, self.models[model])

    def host_kv_bytes(self) -> float:
        return sum(self.models[m].kv_bytes(t) for (m, _), t in self.host_kv.items())

    def incoming_model(self, now: float) -> str | None:
        """The model whose weights are moving into HBM: staged ahead of its slot,
        or being switched in right now. Placement scores it as `staged`."""
        if self.staging is not None:
            return self.staging.model
        if self.switch_in is not None and now < self.switch_in[1]:
            return self.switch_in[0]
        return None

    def host_view(self, model: str) -> dict[str, int]:
        return {sid: t for (m, sid), t in self.host_kv.items() if m == model}

    def check_bounds(self) -> None:
        """Raise if any memory region is over-committed (used by tests and the simulator)."""
        if self.host_kv_bytes() > self.host_kv_capacity_bytes + 1:
            raise AssertionError("host KV tier over-committed")
        if self.staging is not None and self.active is not None:
            spare = self.plan.weights_region_bytes - self.models[self.active].weights_bytes
            if self.staging.nbytes > spare + 1:
                raise AssertionError("staging exceeds the weights region's spare room")

    # -- staging -----------------------------------------------------------------
    def stage(self, model: str, now: float) -> _Staging | None:
        """Begin staging `model` into the weights region's spare room (no-op when
        staging is off, the model is active, or it is staged already)."""
        if not self.policy.staging or model == self.active:
            return None
        if self.staging is not None and self.staging.model == model:
            return self.staging
        active_w = self.models[self.active].weights_bytes if self.active else 0.0
        spare = self.plan.weights_region_bytes - active_w if self.policy.stable_addresses else 0.0
        nbytes = min(self.models[model].weights_bytes, max(0.0, spare))
        self.staging = _Staging(model=model, nbytes=nbytes, started_at=now, ready_at=now + self.cost.h2d_s(nbytes))
        return self.staging

    def staged_fraction(self, model: str) -> float:
        if self.staging is None or self.staging.model != model:
            return 0.0
        return self.staging.nbytes / self.models[model].weights_bytes

    # -- switches ----------------------------------------------------------------
    def plan_switch(self, now: float, to_model: str, kv_out: dict[str, int]) -> SwitchPlan:
        """Plan (and book) a switch from the active model to `to_model`.
        `kv_out` is the old engine's idle KV table at sleep."""
        to = self.models[to_model]
        old = self.models[self.active] if self.active else None
        weights_out_s = 0.0
        weights_in_s = 0.0
        fixed_s = 0.0
        staged = 0.0
        if self.policy.staging:
            # host copy kept: switching out is a discard
            st = self.staging if self.staging is not None and self.staging.model == to_model else None
            if st is not None:
                done = 1.0 if now >= st.ready_at or st.ready_at <= st.started_at else (now - st.started_at) / (st.ready_at - st.started_at)
                staged = st.nbytes * max(0.0, min(1.0, done))
                hidden = now - st.started_at
            else:
                hidden = 0.0
            weights_in_s = self.cost.d2d_s(staged) + self.cost.h2d_s(to.weights_bytes - staged)
            fixed_s += max(0.0, self.cost.wake_residual_s - hidden)
            fixed_s += self.cost.remap_s
        else:
            if old is not None:
                weights_out_s = self.cost.d2h_s(old.weights_bytes) + self.cost.sleep_residual_s
            weights_in_s = self.cost.h2d_s(to.weights_bytes) + self.cost.wake_residual_s
        if not self.policy.stable_addresses:
            fixed_s += self.cost.reinit_s
            self.region_reservations += 1  # engine memory re-created: regions reserved anew
        kv_out_s, to_host, dropped = self._spill_kv(old, kv_out)
        # KV goes device->host while the new weights come host->device (PCIe is full duplex)
        duration = weights_out_s + max(weights_in_s, kv_out_s) + fixed_s
        self.active = to_model
        self.staging = None
        self.switch_in = (to_model, now + duration)
        self.switches += 1
        return SwitchPlan(
            from_model=old.name if old else None,
            to_model=to_model,
            duration_s=duration,
            weights_out_s=weights_out_s,
            weights_in_s=weights_in_s,
            kv_out_s=kv_out_s,
            fixed_s=fixed_s,
            staged_bytes=staged,
            kv_to_host_tokens=to_host,
            kv_dropped_tokens=dropped,
            kv_capacity_tokens=self.kv_capacity_tokens(to_model),
            host_kv_view=self.host_view(to_model) if self.policy.host_kv else {},
        )

    def recover_active(self, model: str) -> None:
        """A restarted substrate-manager learnt from the engine-workers that `model` is
        awake: it is the active one (its host KV tier starts empty: what a
        predecessor spilled is re-prefilled, not restored)."""
        if model in self.models:
            self.active = model

    def finish_switch(self) -> None:
        """The switched-in model is awake: it is active, no longer moving in."""
        self.switch_in = None

    def _spill_kv(self, old: ModelSpec | None, kv_out: dict[str, int]) -> tuple[float, int, int]:
        if old is None or not kv_out:
            return 0.0, 0, 0
        if not self.policy.host_kv:
            dropped = sum(kv_out.values())
            self.kv_bytes_dropped += old.kv_bytes(dropped)
            return 0.0, 0, dropped
        copy_bytes = self._add_host_kv(old, kv_out)
        self._fit_host_tier(keep_model=None)
        return self.cost.d2h_s(copy_bytes), sum(kv_out.values()), 0

    def accept_spill(self, model: str, spilled: dict[str, int]) -> list[str]:
        """The active engine pushed these sessions' KV out of HBM to host DRAM
        (host-KV restore on). Book it; return the sessions of `model` the tier
        could not keep, which the engine must forget."""
        if not spilled:
            return []
        if not self.policy.host_kv:
            raise ValueError("KV spilled to host with host-KV restore off")
        self._add_host_kv(self.models[model], spilled)
        return self._fit_host_tier(keep_model=model)

    def _add_host_kv(self, spec: ModelSpec, kv: dict[str, int]) -> float:
        copy_bytes = 0.0
        for sid, tokens in kv.items():
            key = (spec.name, sid)
            already = self.host_kv.pop(key, 0)
            if tokens > already:  # only the part not already in host DRAM is copied
                copy_bytes += spec.kv_bytes(tokens) - spec.kv_bytes(already)
            self.host_kv[key] = max(tokens, already)  # most recently used last
        self.kv_bytes_to_host += copy_bytes
        return copy_bytes

    def _fit_host_tier(self, keep_model: str | None) -> list[str]:
        """Evict least recently used sessions until the tier fits; `keep_model`'s
        last. Returns the evicted sessions of `keep_model`."""
        lost: list[str] = []
        used = self.host_kv_bytes()
        for last_pass in (False, True):
            for key in list(self.host_kv):
                if used <= self.host_kv_capacity_bytes:
                    return lost
                if (key[0] == keep_model) != last_pass:
                    continue
                t = self.host_kv.pop(key)
                freed = self.models[key[0]].kv_bytes(t)
                used -= freed
                self.kv_evicted_from_host += freed
                if key[0] == keep_model:
                    lost.append(key[1])
        return lost

    def forget_session(self, session_id: str) -> int:
        """A session ended (or idled out): its host KV is released. Returns the tokens released."""
        released = 0
        for key in [k for k in self.host_kv if k[1] == session_id]:
            released += self.host_kv.pop(key)
        return released
