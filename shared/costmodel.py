"""Cost model of one TP=8 server (pure arithmetic, no I/O, no state).

Formulas and figures come from docs/calibration.md via shared/data/catalog.toml:

- prefill of n new tokens over p cached ones: n / R + c_attn * n * (p + n/2) / F
- decode inter-token latency: ITL(batch) interpolated from the measured points,
  scaled per model, plus a KV-read term sum(context) * KV-bytes / HBM bandwidth
- transfers: bytes split over the server's GPUs at the per-GPU link speed
  (host->device and device->host over PCIe, device->device over NVLink).

Every result is in model seconds.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from shared.catalog import GB, Catalog, ModelSpec, ServerProfile

MEDIAN_OUTPUT_TOKENS = 200  # published median output per call (docs/calibration.md)


@dataclass(frozen=True, slots=True)
class CostModel:
    catalog: Catalog
    server: ServerProfile
    # Sensitivity knobs (the sensitivity table in docs/results.md); 1.0 = the catalog's figures.
    switch_cost_scale: float = 1.0
    prefill_speed_scale: float = 1.0
    decode_speed_scale: float = 1.0  # what-ifs only (talaria study sharing): a share of the server's decode

    # -- compute -------------------------------------------------------------
    def prefill_s(self, model: ModelSpec, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        rate = model.prefill_tok_s * self.prefill_speed_scale
        flops = self.server.usable_pflops * 1e15 * self.prefill_speed_scale
        attention = model.attn_flops_per_pair * new_tokens * (cached_tokens + new_tokens / 2) / flops
        return new_tokens / rate + attention

    def base_itl_s(self, batch: int) -> float:
        """Measured inter-token latency of the reference model at this batch size."""
        xs, ys = self.catalog.itl_batch, self.catalog.itl_ms
        b = max(1, batch)
        i = bisect_right(xs, b) - 1
        if i < 0:
            ms = ys[0]
        elif i >= len(xs) - 1:
            # extrapolate along the last segment
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            ms = ys[-1] + slope * (b - xs[-1])
        else:
            frac = (b - xs[i]) / (xs[i + 1] - xs[i])
            ms = ys[i] + frac * (ys[i + 1] - ys[i])
        return ms / 1000.0

    def itl_s(self, model: ModelSpec, batch: int, context_tokens: int) -> float:
        """Seconds per decode step for a batch holding `context_tokens` in total."""
        kv_bytes = context_tokens * model.kv_bytes_per_token + batch * model.kv_bytes_per_seq
        kv_read = kv_bytes / self.server.gpus / (self.server.hbm_tb_s_per_gpu * 1e12)
        return (self.base_itl_s(batch) * model.decode_itl_scale + kv_read) / self.decode_speed_scale

    def decode_alone_s(self, model: ModelSpec, context_tokens: int, output_tokens: int) -> float:
        """Decode time of one call running alone (used by the oracle bound)."""
        # context grows from `context_tokens`; use the midpoint (exact for a linear term)
        mid = context_tokens + output_tokens / 2
        return output_tokens * self.itl_s(model, 1, int(mid))

    # -- transfers -----------------------------------------------------------
    def h2d_s(self, nbytes: float) -> float:
        return nbytes / self.server.gpus / (self.server.h2d_gb_s_per_gpu * GB) * self.switch_cost_scale

    def d2h_s(self, nbytes: float) -> float:
        return self.h2d_s(nbytes)

    def d2d_s(self, nbytes: float) -> float:
        return nbytes / self.server.gpus / (self.server.d2d_gb_s_per_gpu * GB) * self.switch_cost_scale

    def kv_restore_s(self, model: ModelSpec, tokens: int) -> float:
        return self.h2d_s(model.kv_bytes(tokens))

    # -- model switches (fixed parts) ------------------------------------------
    @property
    def wake_residual_s(self) -> float:
        return self.server.wake_residual_s * self.switch_cost_scale

    @property
    def sleep_residual_s(self) -> float:
        return self.server.sleep_residual_s * self.switch_cost_scale

    @property
    def remap_s(self) -> float:
        return self.server.remap_s * self.switch_cost_scale

    @property
    def reinit_s(self) -> float:
        return self.server.reinit_s * self.switch_cost_scale
