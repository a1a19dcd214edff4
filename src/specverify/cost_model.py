"""Step-time cost model: how long one target forward over N flattened tokens, and one draft forward over a
batch of B tokens, take on this machine.

Start-up profile (see `profiling.py`) -> monotone piecewise-linear curve over the profiled token counts,
extended by anchors doubling up to `extend_to` tokens (priced by the last profiled segment's slope; linear
beyond). Prefills are much longer than any decode step the profile measures: their own anchors learn
their times. Refined online from measured forwards:

    predicted(n) = cummax_over_anchors( profile(anchor) * exp(m + g + r[anchor]) ) interpolated at n
                   (an anchor with `_MEASURED_WEIGHT` observations keeps its own value, dip or not)
                   [+ beta * (context_tokens - context_ref)  for the target, when the context term is on]

Each observation moves three terms, each taking in turn a share of what the prediction missed (only a
miss moves anything, so no term slides into another while the prediction is right):
- `m`, the machine's drift, shared by the target, plain-step and draft curves: a slow spell seen only
  by plain steps (speculation off) must also slow the predicted drafts and verification, or plain
  decoding would look worse than speculation merely because it was the one measured lately.
- `g`, the curve's own log-correction: what is persistently different about this curve (verification
  carries sampling work a plain step does not). A shift seen at any budget moves every budget of the
  curve, including ones never chosen, so there is no dead spot.
- `r[anchor]`, a per-anchor residual (an observation between two anchors feeds both with its
  interpolation weights).
- Early on the level's and the residuals' shares are those of running means in which the profile counts
  as `profile_weight` observations (a curve's level over all its observations, an anchor's residual over
  that anchor's), then the `alpha_*` rates (the drift's is always `alpha_drift`): a profile taken in a
  noisy moment, or an anchor first used late, is corrected within a few steps instead of dozens, and
  later one step still moves little.
- Each observation's log-ratio is clipped to +-`clip` around the current prediction before it enters the
  averages, so one 10x outlier moves the prediction by a couple of percent at most. An anchor's residual
  clips its first observations wider (`early_clip / (observations + profile_weight)`, never below
  `clip`): where a budget is first measured the profile is the only other evidence, and a profile 50 %
  off must not take dozens of steps to correct (a plain step measured only now and then while
  speculating would stay dear on paper).
- The first `warmup` observations of each curve are ignored (lazy initialisation, allocator warm-up).
- Context term: an exponentially weighted regression of the residual seconds on the context size (centred
  on its moving average), used only once it explains a fraction of the residual variance.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

ArrayLike = int | float | np.ndarray


def _isotonic(y: np.ndarray) -> np.ndarray:
    """Least-squares non-decreasing fit (pool adjacent violators): a noisy profile point is averaged with
    its neighbours instead of lifting every larger count, as a running maximum would."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in y.tolist():
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return np.concatenate([np.full(int(c), s / c) for s, c in blocks])


# Observation weight at which an anchor's own measurements may price it below a smaller count.
_MEASURED_WEIGHT = 5.0


def _extrapolated_anchors(x: np.ndarray, y: np.ndarray, extend_to: float) -> tuple[np.ndarray, np.ndarray]:
    """Anchors doubling past the last profiled count up to `extend_to`, priced by the last segment's
    slope. They learn like the others: a prefill of 500 tokens measured beyond a profile that stops at
    128 must correct its own anchor, not the last profiled one (which would move every decode step
    priced there, and the slope of every longer prefill with it)."""
    if x.size < 2 or extend_to <= x[-1]:
        return x, y
    slope = max(0.0, (y[-1] - y[-2]) / (x[-1] - x[-2]))
    extra = [x[-1] * 2.0]
    while extra[-1] < extend_to:
        extra.append(extra[-1] * 2.0)
    extra_x = np.asarray(extra)
    return np.concatenate([x, extra_x]), np.concatenate([y, y[-1] + slope * (extra_x - x[-1])])


class _Drift:
    """The machine-wide log speed factor `m`, shared by the curves of one cost model: what changed
    lately. Each observation hands `decay` of it over to the observing curve's own level (leaving that
    curve's prediction as it was), so a lasting change ends up with the curves that measured it. Without
    that nothing pins `m`: any value fits the measured curves once their levels compensate, and the
    unmeasured curve takes the whole wander (speculative steps alone drove it to +0.2, so plain decoding
    was predicted 1.4x its measured time and speculation kept where it lost 8 %)."""

    def __init__(self, alpha: float, half_life: float = math.inf) -> None:
        self.alpha = alpha
        self.decay = 0.0 if math.isinf(half_life) else 1.0 - 0.5 ** (1.0 / half_life)
        self.value = 0.0


class _Curve:
    """One time curve (target, plain step or draft), monotone but where measured, with online
    multiplicative correction."""

    def __init__(
        self,
        tokens: np.ndarray,
        seconds: np.ndarray,
        *,
        alpha_global: float,
        alpha_bucket: float,
        clip: float,
        warmup: int,
        profile_weight: float = 1.0,
        early_clip: float = 1.0,
        extend_to: float = 0.0,
        drift: _Drift | None = None,
    ) -> None:
        x = np.asarray(tokens, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        if x.ndim != 1 or x.shape != y.shape or x.size == 0:
            raise ValueError("a cost curve needs matching 1-D token counts and times")
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))) or np.any(x <= 0) or np.any(y <= 0):
            raise ValueError("token counts and times must be finite and positive")
        order = np.argsort(x, kind="stable")
        x, y = x[order], y[order]
        # Duplicate counts: average them (np.interp needs strictly increasing anchors).
        ux, inv = np.unique(x, return_inverse=True)
        uy = _isotonic(np.bincount(inv, weights=y) / np.bincount(inv))
        self.x, self.base = _extrapolated_anchors(ux, uy, extend_to)
        self.resid = np.zeros_like(self.x)
        self.seen = np.zeros_like(self.x)  # observation weight per anchor
        self.g = 0.0
        self.n_obs = 0
        self.alpha_global = alpha_global
        self.alpha_bucket = alpha_bucket
        self.clip = clip
        self.warmup = warmup
        self.profile_weight = profile_weight
        self.early_clip = early_clip
        self.drift = drift if drift is not None else _Drift(0.0)
        self._refresh()

    # -- prediction ------------------------------------------------------------------------------------

    def _refresh(self) -> None:
        # An anchor never measured takes the residual of its nearest measured neighbours (interpolated
        # in log tokens), so one dear budget does not lift the unmeasured small budgets through the
        # monotone envelope below.
        seen = self.seen > 0
        resid = self.resid
        if seen.any() and not seen.all():
            logx = np.log(self.x)
            resid = np.interp(logx, logx[seen], self.resid[seen])
        y = self.base * np.exp(self.drift.value + self.g + resid)
        # Corrected anchors are kept monotone (more tokens never predicted cheaper) except where
        # measurements say otherwise: on this CPU a target forward over 2 rows takes 0.20 s and over
        # 6 rows 0.14 s (another kernel), and the envelope priced every deep draft at the 2-row cost,
        # so at one request speculative steps came in 12 % under their prediction and drafts were trimmed.
        measured = self.seen >= _MEASURED_WEIGHT
        self.y = np.where(measured, y, np.maximum.accumulate(y))
        self._drift_seen = self.drift.value
        if self.x.size > 1:
            self.slope_hi = max(0.0, (self.y[-1] - self.y[-2]) / (self.x[-1] - self.x[-2]))
        else:
            self.slope_hi = self.y[0] / self.x[0]  # one anchor: assume proportional beyond it

    def predict(self, n: ArrayLike) -> ArrayLike:
        if self._drift_seen != self.drift.value:  # another curve moved the shared drift
            self._refresh()
        scalar = np.ndim(n) == 0
        n_arr = np.asarray(n, dtype=np.float64)
        # Below the first anchor: flat (a forward has a fixed cost); above the last: linear.
        out = np.interp(n_arr, self.x, self.y) + self.slope_hi * np.maximum(n_arr - self.x[-1], 0.0)
        out = np.where(n_arr > 0, out, 0.0)  # nothing to run costs nothing
        return float(out) if scalar else out

    def _weights(self, n: float) -> tuple[int, int, float]:
        """Anchors bracketing n and the weight of the upper one (clamped at both ends)."""
        if n <= self.x[0]:
            return 0, 0, 0.0
        if n >= self.x[-1]:
            last = self.x.size - 1
            return last, last, 0.0
        hi = int(np.searchsorted(self.x, n, side="right"))
        lo = hi - 1
        return lo, hi, float((n - self.x[lo]) / (self.x[hi] - self.x[lo]))

    def seen_near(self, n: float) -> float:
        """Observations (weighted by interpolation) at the anchors that price n."""
        lo, hi, w = self._weights(n)
        return float((1.0 - w) * self.seen[lo] + w * self.seen[hi])

    def base_log(self, n: float) -> float:
        """log of the uncorrected profile at n (extrapolated like the prediction)."""
        if n > self.x[-1] and self.x.size > 1:
            slope = max(0.0, (self.base[-1] - self.base[-2]) / (self.x[-1] - self.x[-2]))
            return math.log(self.base[-1] + slope * (n - self.x[-1]))
        if n > self.x[-1]:
            return math.log(self.base[0] * n / self.x[0])
        return math.log(float(np.interp(n, self.x, self.base)))

    # -- online refinement -----------------------------------------------------------------------------

    def observe(self, n: float, seconds: float) -> bool:
        """Feed one measured forward; returns whether it was used."""
        if not (n > 0 and math.isfinite(seconds) and seconds > 0):
            return False
        self.n_obs += 1
        if self.n_obs <= self.warmup:
            return False
        handover = self.drift.decay * self.drift.value
        self.drift.value -= handover
        self.g += handover
        lo, hi, w = self._weights(n)
        r_n = (1.0 - w) * self.resid[lo] + w * self.resid[hi]
        log_ratio = math.log(seconds) - self.base_log(n)
        m, g = self.drift.value, self.g
        predicted = m + g + r_n
        # Robustness: an outlier can only pull by `clip` (in log space) around the current prediction.
        # An anchor's first observations may correct a profile that is far off (the profile is but one
        # observation): for its residual the clip starts wide and narrows to `clip` as the anchor's
        # evidence grows, so a budget first measured late is not held back to `clip` per step.
        seen = (1.0 - w) * self.seen[lo] + w * self.seen[hi]
        wide = max(self.clip, self.early_clip / (seen + self.profile_weight))
        error = min(max(log_ratio - predicted, -self.clip), self.clip)
        wide_error = min(max(log_ratio - predicted, -wide), wide)
        # Each term takes its share of what the prediction missed, in turn: the machine's drift (shared
        # by every curve), the curve's level, the anchors' residuals. Only a miss moves anything: when
        # the level chased a residual even with the prediction right, the shared drift paid for the
        # overshoot, and a plain curve 2x its profile dragged the other curves' predictions down to 0.4x.
        step_m = self.drift.alpha * error
        used = self.n_obs - self.warmup
        step_g = max(self.alpha_global, 1.0 / (used + self.profile_weight)) * (error - step_m)
        self.drift.value += step_m
        self.g += step_g
        left = wide_error - step_m - step_g
        for anchor, weight in ((lo, 1.0 - w), (hi, w)) if hi != lo else ((lo, 1.0),):
            self.seen[anchor] += weight
            rate = weight * max(self.alpha_bucket, 1.0 / (self.seen[anchor] + self.profile_weight))
            self.resid[anchor] += rate * left
        self._refresh()
        return True

    # -- persistence -----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.x.tolist(),
            "base": self.base.tolist(),
            "resid": self.resid.tolist(),
            "seen": self.seen.tolist(),
            "g": self.g,
            "n_obs": self.n_obs,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], drift: _Drift | None = None, **params: Any) -> _Curve:
        curve = cls(np.asarray(d["tokens"]), np.asarray(d["base"]), drift=drift, **params)
        curve.resid = np.asarray(d.get("resid", np.zeros(curve.x.size)), dtype=np.float64)
        curve.seen = np.asarray(d.get("seen", (curve.resid != 0).astype(float)), dtype=np.float64)
        curve.g = float(d.get("g", 0.0))
        curve.n_obs = int(d.get("n_obs", 0))
        curve._refresh()
        return curve


class CostModel:
    """Predicted seconds of a target forward (by flattened token count) and of a draft forward (by batch).

    Build with `CostModel.from_profile(profile)`; refine with `observe_target` / `observe_draft`.
    `target_time` and `draft_time` accept an int or an array of counts (vectorised for the planner).
    """

    def __init__(
        self,
        target_tokens: np.ndarray | list[float],
        target_seconds: np.ndarray | list[float],
        draft_tokens: np.ndarray | list[float] | None = None,
        draft_seconds: np.ndarray | list[float] | None = None,
        *,
        alpha_global: float = 0.02,
        alpha_bucket: float = 0.02,
        alpha_drift: float = 0.1,
        drift_half_life: float = 100.0,
        clip: float = 0.15,
        warmup: int = 3,
        profile_weight: float = 1.0,
        early_clip: float = 1.0,
        extend_to: float = 8192.0,
        fit_context: bool = True,
        context_alpha: float = 0.02,
        context_min_r2: float = 0.1,
        context_min_obs: int = 30,
    ) -> None:
        self._params = dict(
            alpha_global=alpha_global,
            alpha_bucket=alpha_bucket,
            clip=clip,
            warmup=warmup,
            profile_weight=profile_weight,
            early_clip=early_clip,
            extend_to=extend_to,
        )
        self.alpha_drift = alpha_drift
        self.drift_half_life = drift_half_life
        self.drift = _Drift(alpha_drift, drift_half_life)
        curve = dict(self._params, drift=self.drift)
        self.target = _Curve(np.asarray(target_tokens), np.asarray(target_seconds), **curve)
        # A plain step (no drafts) learns apart from the verify phase: verification carries overhead of
        # its own (probabilities and rejection sampling over every verified row), and a factor shared
        # with it made plain decoding look slower than it is, keeping speculation on where it lost.
        self.plain = _Curve(np.asarray(target_tokens), np.asarray(target_seconds), **curve)
        self.draft = (
            None
            if draft_tokens is None
            else _Curve(np.asarray(draft_tokens), np.asarray(draft_seconds), **curve)
        )
        # Context term state (target only).
        self.fit_context = fit_context
        self.context_alpha = context_alpha
        self.context_min_r2 = context_min_r2
        self.context_min_obs = context_min_obs
        self.context_ref = 0.0
        self.context_coef = 0.0  # seconds per context token, relative to context_ref
        self._ctx_n = 0
        self._sxx = self._sxy = self._syy = 0.0

    # -- construction ----------------------------------------------------------------------------------

    @classmethod
    def from_profile(cls, profile: dict[str, Any], **kwargs: Any) -> CostModel:
        """From `profiling.profile_runners`' dict: {"target": {"tokens", "seconds"}, "draft": ... | None}."""
        t = profile["target"]
        d = profile.get("draft")
        return cls(
            t["tokens"],
            t["seconds"],
            None if d is None else d["tokens"],
            None if d is None else d["seconds"],
            **kwargs,
        )

    # -- prediction ------------------------------------------------------------------------------------

    def target_time(self, num_tokens: ArrayLike, context_tokens: ArrayLike = 0) -> ArrayLike:
        """Seconds for one target forward over `num_tokens` flattened tokens; `context_tokens` (total KV
        length attended to) adds the fitted context term when one is active."""
        t = self.target.predict(num_tokens)
        if self.context_coef != 0.0 and np.any(np.asarray(context_tokens) != 0):
            extra = self.context_coef * (np.asarray(context_tokens, dtype=np.float64) - self.context_ref)
            # Never below half the context-free prediction: the term is a correction, not the model.
            t = np.maximum(t + extra, 0.5 * np.asarray(t))
            t = float(t) if np.ndim(t) == 0 else t
        return t

    def plain_time(self, num_tokens: ArrayLike) -> ArrayLike:
        """Seconds for one whole step without speculation over `num_tokens` tokens."""
        return self.plain.predict(num_tokens)

    def plain_observations(self, num_tokens: int) -> float:
        """How many plain steps near `num_tokens` tokens have been measured (0: only predicted)."""
        return self.plain.seen_near(float(num_tokens))

    def observe_plain(self, num_tokens: int, seconds: float) -> None:
        """Feed the measured time of one step without speculation."""
        self.plain.observe(float(num_tokens), float(seconds))

    def draft_time(self, batch_tokens: ArrayLike) -> ArrayLike:
        """Seconds for one draft forward over `batch_tokens` tokens (0 when there is no draft profile)."""
        if self.draft is None:
            return 0.0 if np.ndim(batch_tokens) == 0 else np.zeros(np.shape(batch_tokens))
        return self.draft.predict(batch_tokens)

    # -- online refinement -----------------------------------------------------------------------------

    def observe_target(self, num_tokens: int, seconds: float, context_tokens: int = 0) -> None:
        """Feed the measured time of one target forward."""
        if self.fit_context and context_tokens > 0 and self.target.n_obs >= self.target.warmup:
            self._observe_context(num_tokens, seconds, float(context_tokens))
            # The multiplicative curve learns context-normalised times, so the two parts do not fight.
            if self.context_coef != 0.0:
                seconds = seconds - self.context_coef * (context_tokens - self.context_ref)
                seconds = max(seconds, 0.5 * float(self.target.predict(num_tokens)))
        self.target.observe(float(num_tokens), float(seconds))

    def observe_draft(self, batch_tokens: int, seconds: float) -> None:
        """Feed the measured time of one draft forward."""
        if self.draft is not None:
            self.draft.observe(float(batch_tokens), float(seconds))

    def _observe_context(self, num_tokens: int, seconds: float, context: float) -> None:
        a = self.context_alpha
        self._ctx_n += 1
        self.context_ref = (
            context if self._ctx_n == 1 else self.context_ref + a * (context - self.context_ref)
        )
        x = context - self.context_ref
        y = seconds - float(self.target.predict(num_tokens))
        self._sxx += a * (x * x - self._sxx)
        self._sxy += a * (x * y - self._sxy)
        self._syy += a * (y * y - self._syy)
        coef = 0.0
        if self._ctx_n >= self.context_min_obs and self._sxx > 0 and self._syy > 0:
            r2 = self._sxy * self._sxy / (self._sxx * self._syy)
            if r2 >= self.context_min_r2 and self._sxy > 0:  # more context never makes a step faster
                coef = self._sxy / self._sxx
        self.context_coef = coef

    # -- persistence -----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 2,
            "params": dict(self._params, alpha_drift=self.alpha_drift, drift_half_life=self.drift_half_life),
            "drift": self.drift.value,
            "target": self.target.to_dict(),
            "plain": self.plain.to_dict(),
            "draft": None if self.draft is None else self.draft.to_dict(),
            "context": {
                "fit": self.fit_context,
                "alpha": self.context_alpha,
                "min_r2": self.context_min_r2,
                "min_obs": self.context_min_obs,
                "ref": self.context_ref,
                "coef": self.context_coef,
                "n": self._ctx_n,
                "sxx": self._sxx,
                "sxy": self._sxy,
                "syy": self._syy,
            },
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        params = d.get("params", {})
        ctx = d.get("context", {})
        model = cls(
            d["target"]["tokens"],
            d["target"]["base"],
            None if d.get("draft") is None else d["draft"]["tokens"],
            None if d.get("draft") is None else d["draft"]["base"],
            **params,
            fit_context=ctx.get("fit", True),
            context_alpha=ctx.get("alpha", 0.02),
            context_min_r2=ctx.get("min_r2", 0.1),
            context_min_obs=ctx.get("min_obs", 30),
        )
        model.drift.value = float(d.get("drift", 0.0))
        model.target = _Curve.from_dict(d["target"], model.drift, **model._params)
        model.plain = _Curve.from_dict(d.get("plain", d["target"]), model.drift, **model._params)
        if d.get("draft") is not None:
            model.draft = _Curve.from_dict(d["draft"], model.drift, **model._params)
        model.context_ref = float(ctx.get("ref", 0.0))
        model.context_coef = float(ctx.get("coef", 0.0))
        model._ctx_n = int(ctx.get("n", 0))
        model._sxx = float(ctx.get("sxx", 0.0))
        model._sxy = float(ctx.get("sxy", 0.0))
        model._syy = float(ctx.get("syy", 0.0))
        return model

    def __repr__(self) -> str:
        return (
            f"CostModel(target 1 tok {self.target_time(1) * 1e3:.1f} ms, 32 tok {self.target_time(32) * 1e3:.1f} ms; "
            f"draft 1 seq {self.draft_time(1) * 1e3:.1f} ms)"
        )
