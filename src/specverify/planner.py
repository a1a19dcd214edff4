"""Adaptive-verification planner: how deep to draft, when to stop drafting a request, which drafts to verify.

Notation for one step with R running requests: p[r, k] = P(accept slot k | slots < k accepted) from the
estimator; survival s[r, k] = prod_{i<=k} p[r, i] = P(slot k is accepted). Verifying a set S of slots
yields R + sum_{(r,k) in S} s[r,k] expected tokens (every request gets one target token) and costs
D draft forwards (the first reads what the last step left, up to 2R tokens) + target_time(R + |S|).
In the steady state the planner maximises expected tokens per second; that best rate lambda (the value
of a second) then prices what a single step must pay on top: the draft's catch-up (tokens it has not
consumed yet: a new prompt, or what it missed while speculation was off; amortised over the steps the
requests still have) and prefill (shared by every option). A step's choice maximises
tokens - lambda * seconds, which equals the rate rule when there is nothing on top.

The plan's depth prices whether speculation pays and fixes tau; how deep each request drafts is then
`should_continue`'s call, up to K. The plan rests on survivals pooled over recent steps, extrapolated past
where they were drafted with the mean acceptance per position, and so under-rates requests whose drafts
keep being accepted (survival is correlated along a request); the per-row rule sees each row's own.

The drafts' expected gain is scaled by `gain_factor`, the realised over the expected gain of the drafts
`admit` verified on the speculative steps the planner chose (their survivals summed; decaying sums with
a prior; `observe_tokens`): the time side has the cost model's online correction, this is the token
side's. Calibrated per-slot estimates still promise more than comes where requests end at EOS or are
capped near max_tokens. With speculation off the sums decay back to the prior, so a low factor does not
keep speculation off for good.

LOSSLESSNESS (DESIGN §5). Whether slot k of request r is verified may depend on the prefix and on draft
distributions up to k (hence on s[r, <=k]) and on other requests, but never on the token drafted at k,
i.e. never on s[r, j > k]. So:
- `admit` uses a survival threshold `tau` fixed before this step's drafts: (r, k) is verified iff
  s[r, k] >= tau (and every earlier slot of r is). That reads s[r, <=k] only.
- `tau` is computed from *previous* steps' survivals (kept in a short history), the cost model and this
  step's R and depth, all known before drafting. Choosing the budget by maximising over THIS step's
  survivals would let s[r, k+1] (a function of the token at k) decide whether k is verified.
- `top_b_prefix` (fixed budget B, global top-B) is lossless too, because s is non-increasing along a
  request and ties are broken by position, so later slots of r never outrank (r, k).
- `should_continue` (stop drafting r after slot k) reads s[r, <=k] and earlier steps only.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from specverify.cost_model import CostModel


def survival(p: np.ndarray) -> np.ndarray:
    """Cumulative product of acceptance probabilities along the last axis; NaN (not drafted) counts as 0,
    so every slot after an undrafted one has survival 0. Probabilities are clipped to [0, 1]."""
    p = np.clip(np.nan_to_num(np.asarray(p, dtype=np.float64), nan=0.0), 0.0, 1.0)
    return np.cumprod(p, axis=-1)


def reached_acceptance(p: np.ndarray) -> np.ndarray:
    """Mean acceptance per position among the drafts that reach it: p [N, K] (NaN = not drafted) ->
    [K], NaN where nothing was drafted. Slot k of a row counts with weight s[k-1], the chance that its
    earlier slots were all accepted: a calibrated estimate of P(accept k | slots < k accepted) is only
    about those. An unweighted mean over every drafted slot (or over every position's features pooled)
    also counts the drafts that go on after a likely rejection, whose lower q_max pulled the look-ahead
    ~0.1 below the realised acceptance at greedy c1 and kept speculation off there."""
    p = np.asarray(p, dtype=np.float64)
    if p.ndim != 2 or p.size == 0:
        return np.full(p.shape[-1] if p.ndim else 0, np.nan)
    drafted = np.isfinite(p)
    reach = np.concatenate([np.ones((p.shape[0], 1)), survival(p)[:, :-1]], axis=1)
    weight = np.where(drafted, reach, 0.0)
    total = weight.sum(axis=0)
    accepted = (weight * np.where(drafted, np.clip(p, 0.0, 1.0), 0.0)).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0.0, accepted / total, np.nan)


def top_b_prefix(survival: np.ndarray, budget: int) -> np.ndarray:
    """Verified slots per request for a global top-`budget` by survival, ties broken by position first
    (so (r, k) always ranks above (r, k+1)) then by request. Returns a prefix length per request.

    Lossless only if `budget` was fixed before this step's drafts (see the module docstring)."""
    s = np.nan_to_num(np.asarray(survival, dtype=np.float64), nan=0.0)
    if s.ndim != 2 or s.size == 0 or budget <= 0:
        return np.zeros(s.shape[0] if s.ndim == 2 else 0, dtype=np.int64)
    # Make survivals non-increasing along each request (estimates are, up to rounding) so that the
    # ranking of (r, k) can never depend on a later slot of the same request.
    s = np.minimum.accumulate(s, axis=1)
    r_count, depth = s.shape
    rows = np.repeat(np.arange(r_count), depth)
    cols = np.tile(np.arange(depth), r_count)
    order = np.lexsort((rows, cols, -s.ravel()))  # primary: survival desc; then position; then request
    chosen = np.zeros(s.size, dtype=bool)
    top = order[: min(int(budget), s.size)]
    chosen[top] = s.ravel()[top] > 0.0
    return np.cumprod(chosen.reshape(r_count, depth), axis=1).sum(axis=1)


class AdaptivePlanner:
    """Per-step decisions of adaptive verification, driven by a `CostModel`.

    Engine protocol per step: `choose_draft_depth(R, expected_p)` (0 = no speculation this step) ->
    draft up to K, calling `should_continue(s[:, k], k + 1)` after each draft forward -> `admit(s)` ->
    target forward -> `observe_tokens(emitted)` -> `end_step(s, num_verified)`.

    Last decisions, for metrics: `depth`, `threshold`, `budget` (slots admitted by the last `admit`),
    `planned_budget` (expected admitted slots when the depth was chosen), `expected_tokens`,
    `expected_seconds` and `expected_rate` (tokens per second of the chosen plan), `value_of_time` (tokens per second of the
    best steady plan: what a second of drafting or verifying must buy).
    """

    def __init__(
        self,
        cost: CostModel,
        num_speculative_tokens: int,
        *,
        history_steps: int = 8,
        min_gain: float = 0.02,
        initial_threshold: float = 0.0,
        gain_prior_tokens: float = 20.0,
        gain_half_life_steps: float = 32.0,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.cost = cost
        self.k = int(num_speculative_tokens)
        # Survival rows of recent steps, padded to K columns with NaN (= not drafted that step).
        self.history: deque[np.ndarray] = deque(maxlen=max(1, history_steps))
        # Speculation must beat plain decoding by this relative margin: cost profiles are noisy and
        # switching speculation back on costs a draft catch-up forward the model does not see.
        self.min_gain = float(min_gain)
        # Realised / expected draft gain: decaying sums (per planned step) over a prior of
        # `gain_prior_tokens` expected tokens that came as expected.
        self.gain_prior_tokens = float(gain_prior_tokens)
        self._gain_decay = 0.5 ** (1.0 / gain_half_life_steps)
        self._gain_expected = 0.0
        self._gain_realised = 0.0
        self._planned_gain = 0.0  # summed survivals of the last admitted drafts (what the factor corrects)
        self.gain_factor = 1.0
        self.value_of_time = 0.0  # tokens/second of the best steady plan (lambda); prices drafting time
        self.expected_p = np.zeros(self.k)
        self.threshold = float(initial_threshold)  # 0: verify everything drafted until we know better
        self.depth = 0
        self.planned_budget = 0.0
        self.budget = 0
        self.expected_tokens = 0.0
        self.expected_rate = 0.0
        self.expected_seconds = 0.0  # predicted time of the chosen plan's step (prefill included)
        self.num_requests = 0
        self.context_tokens = 0
        self.prefill_tokens = 0

    # ---- helpers ------------------------------------------------------------------------------------

    def _clean_expected(self, expected_p: np.ndarray | None) -> np.ndarray:
        """Length-K acceptance means; NaN positions copy the previous position (a position never drafted
        must not look hopeless forever), leading NaN -> 0."""
        if expected_p is None:
            return self.expected_p
        p = np.asarray(expected_p, dtype=np.float64).ravel()[: self.k]
        if p.size < self.k:
            p = np.concatenate([p, np.full(self.k - p.size, np.nan)])
        if np.isnan(p).any():
            idx = np.where(np.isnan(p), 0, np.arange(self.k))
            idx = np.maximum.accumulate(idx)
            p = p[idx]
            p = np.nan_to_num(p, nan=0.0)
        return np.clip(p, 0.0, 1.0)

    def _pooled(self, expected_p: np.ndarray) -> np.ndarray:
        """Recent survival rows, [M, K]; columns not drafted are extrapolated with the expected
        acceptance (what deeper drafting would have given). No history: one row of mean survival."""
        if not self.history:
            return np.cumprod(expected_p)[None, :]
        s = np.concatenate(list(self.history), axis=0)
        missing = np.isnan(s)
        if missing.any():
            s = s.copy()
            prev = np.ones(s.shape[0])
            for k in range(self.k):  # loop over positions only (K <= 16)
                col = s[:, k]
                s[:, k] = np.where(missing[:, k], prev * expected_p[k], col)
                prev = s[:, k]
        return s

    def _plan(
        self,
        r_count: int,
        depths: np.ndarray,
        pooled: np.ndarray,
        context_tokens: int,
        *,
        target_feed: int | None = None,
        draft_feed: int | None = None,
        value_of_time: float | None = None,
        horizon: float = 1.0,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For each candidate depth D, the best global budget on the pooled survivals.

        Pooled rows stand for R requests: budget j of the pooled slots means j * R / M target tokens.
        `target_feed` / `draft_feed`: tokens each model must consume before this step's new ones (a
        prompt being prefilled, the tokens the draft missed while speculation was off); default R.
        Budgets are ranked by expected tokens per second, or, given `value_of_time` (tokens per second
        the engine can make anyway), by tokens - value_of_time * seconds.
        Returns (score[D], tokens[D], budget[D] in target tokens, threshold[D], seconds[D])."""
        m = pooled.shape[0]
        scale = r_count / m
        target_feed = r_count if target_feed is None else max(int(target_feed), r_count)
        draft_feed = r_count if draft_feed is None else max(int(draft_feed), r_count)
        flat = pooled.ravel()
        cols = np.tile(np.arange(self.k), m)
        order = np.argsort(-flat, kind="stable")
        v, c = flat[order], cols[order]
        # mask[d, j]: sorted slot j is drafted under depth depths[d]
        mask = c[None, :] < depths[:, None]
        gain = np.concatenate([np.zeros((depths.size, 1)), np.cumsum(v * mask, axis=1)], axis=1)
        count = np.concatenate([np.zeros((depths.size, 1)), np.cumsum(mask, axis=1)], axis=1)
        budget_tokens = count * scale
        tokens = r_count + gain * scale * self.gain_factor
        # Every speculative step leaves the draft 1-2 tokens per request (correction, or last draft and
        # bonus): its first forward reads up to 2R every step (priced as R, a c4 plan ran 7 % fast). The
        # rest is a catch-up (prompt, tokens missed while plain) that later steps reuse: 1 / horizon.
        every_step = min(draft_feed, 2 * r_count)
        first = self.cost.draft_time(every_step)
        catchup = (self.cost.draft_time(draft_feed) - first) / max(horizon, 1.0)
        later_forwards = np.maximum(depths - 1, 0) * self.cost.draft_time(r_count)
        draft_cost = np.where(depths > 0, first + later_forwards + catchup, 0.0)
        # Depth 0 is a plain step, with its own measured cost (no verification overhead). Tokens being
        # prefilled cost every option the same, so one curve prices them for all: two curves, each
        # extrapolated far from where it was measured, would differ by more than the drafts cost.
        prefill = self.cost.plain_time(target_feed) - self.cost.plain_time(r_count)
        # Verified drafts ride in the same forward as the tokens being prefilled: they cost what they add
        # there (on this CPU a verified token added 6.8 ms to a 527-token prefill forward, 4.2 ms to a
        # 15-token decode forward), not what they would add to a decode-only forward.
        # Without a prefill (target_feed == r_count) this is target_time(r_count + budget).
        seconds = (
            draft_cost[:, None]
            + self.cost.target_time(r_count, context_tokens)
            + self.cost.target_time(target_feed + budget_tokens, context_tokens)
            - self.cost.target_time(target_feed, context_tokens)
        )
        seconds[depths == 0] = self.cost.plain_time(r_count)
        seconds = seconds + prefill
        seconds = np.maximum(seconds, 1e-12)
        score = tokens / seconds if value_of_time is None else tokens - value_of_time * seconds
        best = np.argmax(score, axis=1)
        rows = np.arange(depths.size)
        # Threshold halfway between the last admitted and the first rejected survival (of that depth).
        nb = count[rows, best]
        drafted_rank = count[:, 1:]
        last_in = np.where(mask & (drafted_rank <= nb[:, None]), v[None, :], np.inf).min(axis=1)
        first_out = np.where(mask & (drafted_rank > nb[:, None]), v[None, :], -np.inf).max(axis=1)
        first_out = np.where(np.isfinite(first_out), first_out, 0.0)
        last_in = np.where(np.isfinite(last_in), last_in, 1.0 + 1e-9)  # none admitted: above any survival
        thresholds = 0.5 * (last_in + first_out)
        return (
            score[rows, best],
            tokens[rows, best],
            budget_tokens[rows, best],
            thresholds,
            seconds[rows, best],
        )

    # ---- decisions ----------------------------------------------------------------------------------

    def choose_draft_depth(
        self,
        num_requests: int,
        expected_p: np.ndarray | None = None,
        context_tokens: int = 0,
        *,
        target_feed_tokens: int | None = None,
        draft_feed_tokens: int | None = None,
        remaining_tokens: float | None = None,
        steady_requests: int | None = None,
    ) -> int:
        """Draft depth D in 0..K for this step (0: plain decoding).

        First the steady state (every request feeding one token to each model): the best expected
        tokens/second over depths and budgets is the value of time lambda. Then this step, with what
        each model must consume first (`target_feed_tokens`: prompts being prefilled; `draft_feed_tokens`:
        the draft's catch-up), maximises tokens - lambda * seconds. In the steady state both give the
        same choice; with a large shared prefill, maximising this step's rate would add drafts whose
        extra tokens come at a worse rate than plain decoding gives later. The catch-up is amortised
        over the steps the requests will still speculate: `remaining_tokens` (mean per request) over the
        steady plan's tokens per request and step (unknown: charged whole), and not at all (charged
        whole) where the steady state at `steady_requests` (the batch once waiting requests have joined;
        default: this one), each of its requests paying a catch-up like these over the same horizon,
        says plain decoding: no later speculative step would reuse it.

        Uses previous steps' survivals (extrapolated with `expected_p`, the recent mean acceptance per
        position) so heterogeneous requests are admitted top-first. Also fixes this step's admission
        threshold, before any draft is seen (lossless)."""
        r_count = int(num_requests)
        self.num_requests = r_count
        self.context_tokens = int(context_tokens)
        # Prompt tokens this step's forward also carries (priced into `should_continue`'s slots too).
        self.prefill_tokens = max(0, int(target_feed_tokens or 0) - r_count)
        self.expected_p = self._clean_expected(expected_p)
        self._gain_expected *= self._gain_decay
        self._gain_realised *= self._gain_decay
        self._planned_gain = 0.0
        self._refresh_gain_factor()  # drifts back to the prior while unmeasured
        if r_count <= 0:
            self.depth, self.planned_budget, self.expected_tokens, self.expected_rate = 0, 0.0, 0.0, 0.0
            self.expected_seconds = 0.0
            return 0
        depths = np.arange(self.k + 1)
        pooled = self._pooled(self.expected_p)
        # The steady state's first draft forward reads what a speculative step leaves behind (see _plan).
        lag = None if draft_feed_tokens is None else min(int(draft_feed_tokens), 2 * r_count)
        steady, steady_tokens, *_ = self._plan(r_count, depths, pooled, context_tokens, draft_feed=lag)
        self.value_of_time = float(steady.max())
        horizon = 1.0  # uncapped: a 16-step cap kept whole requests plain at c1 (8a97df9)
        catchup = lag is not None and self.cost.draft_time(draft_feed_tokens) != self.cost.draft_time(lag)
        if remaining_tokens is not None and catchup:  # the horizon only spreads a catch-up (see _plan)
            per_step = float(steady_tokens[1:].max()) / r_count  # tokens per request and step, drafting
            horizon = max(1.0, float(remaining_tokens) / max(per_step, 1.0))
            # Would speculation pay in the steady state at the batch the joining requests make, each
            # paying its catch-up over the horizon (the joining ones taken to lag like these)? If not, no
            # later step reuses this step's catch-up: it is charged whole. Without this, the first prefill
            # step of a burst speculated (the steady state at 8 said drafting won by a hair), then the
            # catch-up of the rest kept every later step plain: 1.2 s of draft prefill wasted.
            coming = r_count if steady_requests is None else max(int(steady_requests), r_count)
            scale = coming / r_count
            draft_feed = int(draft_feed_tokens * scale)
            later, *_ = self._plan(
                coming, depths, pooled, int(context_tokens * scale), draft_feed=draft_feed, horizon=horizon
            )
            if not self._speculation_wins(later):
                horizon = 1.0
        score, tokens, budget, thresholds, seconds = self._plan(
            r_count,
            depths,
            pooled,
            context_tokens,
            target_feed=target_feed_tokens,
            draft_feed=draft_feed_tokens,
            value_of_time=self.value_of_time,
            horizon=horizon,
        )
        best = int(np.argmax(score[1:])) + 1
        # Speculation must win by min_gain: in the steady state this is rate >= plain * (1 + min_gain).
        if score[best] - score[0] < self.min_gain * r_count:
            best = 0
        # Ties between depths go to the shallower one (argmax takes the first): it drafts less.
        self.depth = best
        self.expected_tokens = float(tokens[best])
        self.expected_rate = float(tokens[best] / seconds[best])
        self.expected_seconds = float(seconds[best])
        self.planned_budget = float(budget[best])
        if best > 0:
            self.threshold = float(thresholds[best])
        return best

    def observe_tokens(self, tokens: float) -> None:
        """Tokens the last step emitted, if it speculated as planned (`admit` chose its verified drafts):
        updates `gain_factor` (realised over expected draft gain, beyond the one token per request)."""
        if self._planned_gain <= 0.0:
            return
        self._gain_expected += self._planned_gain
        self._gain_realised += max(float(tokens) - self.num_requests, 0.0)
        self._planned_gain = 0.0
        self._refresh_gain_factor()

    def gain_state(self) -> dict[str, float]:
        """The decaying sums behind `gain_factor`, to carry into another planner."""
        return {"expected": self._gain_expected, "realised": self._gain_realised}

    def load_gain_state(self, state: dict[str, float]) -> None:
        self._gain_expected = max(float(state["expected"]), 0.0)
        self._gain_realised = max(float(state["realised"]), 0.0)
        self._refresh_gain_factor()

    def _refresh_gain_factor(self) -> None:
        prior = self.gain_prior_tokens
        ratio = (self._gain_realised + prior) / (self._gain_expected + prior)
        self.gain_factor = float(np.clip(ratio, 0.5, 1.5))

    def could_pay(self, num_requests: int, context_tokens: int = 0) -> bool:
        """Whether speculation could beat plain decoding at this load if the drafts were better than
        estimated (each position's rejection rate halved). False: probing would only cost."""
        r_count = int(num_requests)
        if r_count <= 0:
            return False
        optimistic = 1.0 - 0.5 * (1.0 - self.expected_p)
        rate, *_ = self._plan(r_count, np.arange(self.k + 1), np.cumprod(optimistic)[None, :], context_tokens)
        return self._speculation_wins(rate)

    def _speculation_wins(self, rate: np.ndarray) -> bool:
        """Whether some depth's steady rate (tokens/second, depth 0 first) beats plain by `min_gain`."""
        return bool(rate[1:].max() >= rate[0] * (1.0 + self.min_gain))

    def should_continue(
        self,
        survival_so_far: np.ndarray,
        depth_done: int,
        expected_p: np.ndarray | None = None,
        num_tokens_so_far: int | None = None,
        max_depth: int | None = None,
        last_acceptance: np.ndarray | None = None,
    ) -> np.ndarray:
        """Per request (of those still drafting), whether to draft slot `depth_done` (0-based; i.e. the
        (depth_done+1)-th).

        `survival_so_far[r]` = s[r, depth_done - 1] (1 for depth_done = 0). A request drafting j more
        slots gains s * (p + p^2 + ... + p^j), p its `last_acceptance` (the predicted acceptance of the
        slot it just drafted: a long suffix match stays accepted) or, without it, the recent mean
        acceptance per position. The m requests that gain most from j slots cost j draft forwards over m
        plus m * j more verified tokens. With the plan's rate lambda, the (m, j) maximising
        gain - lambda * cost decides: its m requests draft the next slot (one slot alone stopped at the
        CPU's int4-to-bf16 jump, cheap slots behind it). Reads only slots drafted so far and earlier
        steps (lossless)."""
        s = np.clip(np.nan_to_num(np.asarray(survival_so_far, dtype=np.float64).ravel(), nan=0.0), 0.0, 1.0)
        n = s.size
        limit = self.k if max_depth is None else min(int(max_depth), self.k)
        if n == 0 or depth_done >= limit or depth_done < 0:
            return np.zeros(n, dtype=bool)
        p = self._clean_expected(expected_p) if expected_p is not None else self.expected_p
        ahead = p[depth_done:limit]
        if last_acceptance is None:
            future = np.broadcast_to(ahead, (n, ahead.size))
        else:  # each request's next slots are accepted as its last one was
            own = np.clip(np.nan_to_num(np.asarray(last_acceptance, dtype=np.float64).ravel()), 0.0, 1.0)
            future = np.broadcast_to(own[:, None], (n, ahead.size))
        # Expected tokens from the next j slots, j = 1 .. limit - depth_done, per request: [n, J].
        gain = s[:, None] * np.cumsum(np.cumprod(future, axis=1), axis=1) * self.gain_factor
        order = np.argsort(-gain, axis=0, kind="stable")  # best requests first, for each j
        gain_cum = np.concatenate(
            [np.zeros((1, ahead.size)), np.cumsum(np.take_along_axis(gain, order, 0), 0)]
        )
        m = np.arange(n + 1)[:, None]
        j = np.arange(1, ahead.size + 1)[None, :]
        r_all = max(self.num_requests, n)
        base = (
            r_all + depth_done * n + self.prefill_tokens
            if num_tokens_so_far is None
            else int(num_tokens_so_far)
        )
        ctx = self.context_tokens
        cost = (
            j * self.cost.draft_time(m)
            + self.cost.target_time(base + m * j, ctx)
            - self.cost.target_time(base, ctx)
        )
        rate = self.value_of_time
        if rate <= 0.0:  # no plan yet: compare with plain decoding
            rate = r_all / max(float(self.cost.plain_time(r_all)), 1e-12)
        value = gain_cum - rate * cost
        best_m, best_j = np.unravel_index(int(np.argmax(value)), value.shape)
        out = np.zeros(n, dtype=bool)
        out[order[:best_m, best_j]] = True
        return out & (gain[:, 0] > 0.0)

    def admit(self, survival: np.ndarray, threshold: float | None = None) -> np.ndarray:
        """Verified slots per request (a prefix): slot k of r is verified iff s[r, j] >= tau for all j <= k.
        tau was fixed before this step's drafts; undrafted slots (NaN or 0) are never verified."""
        s = np.asarray(survival, dtype=np.float64)
        if s.ndim != 2 or s.shape[0] == 0:
            self.budget = 0
            return np.zeros(s.shape[0] if s.ndim >= 1 else 0, dtype=np.int64)
        tau = self.threshold if threshold is None else float(threshold)
        ok = np.cumprod((s >= tau) & (s > 0.0), axis=1).astype(bool)  # NaN compares False
        n = ok.sum(axis=1).astype(np.int64)
        self.budget = int(n.sum())
        if self.depth > 0:  # a planned step: its expected draft gain
            self._planned_gain = float(s[ok].sum())
        return n

    def end_step(
        self,
        survival: np.ndarray,
        num_verified: np.ndarray | None = None,
        *,
        target_tokens: int | None = None,
        target_seconds: float | None = None,
        draft_forwards: list[tuple[int, float]] | None = None,
        context_tokens: int = 0,
        nothing_to_draft: np.ndarray | None = None,
    ) -> None:
        """Remember this step's survivals (they set the next step's threshold, never this one's) and
        refresh the threshold for an unchanged load. Optionally feed measured times to the cost model:
        `target_seconds` of the forward over `target_tokens`, and (batch, seconds) per draft forward.
        Zero survival beyond a request's drafted depth is read as 'not drafted' (deeper drafting would
        have given the expected acceptance), except at the slots `nothing_to_draft` marks: there the
        drafter had nothing to propose (a suffix drafter without a match), so they really gain 0."""
        s = np.asarray(survival, dtype=np.float64)
        if target_seconds is not None and target_tokens:
            self.cost.observe_target(int(target_tokens), float(target_seconds), context_tokens)
        for batch, seconds in draft_forwards or ():
            self.cost.observe_draft(int(batch), float(seconds))
        if s.ndim != 2 or s.shape[0] == 0 or s.shape[1] == 0:
            return
        d = min(s.shape[1], self.k)
        row = np.full((s.shape[0], self.k), np.nan)
        part = s[:, :d]
        # Survival is positive wherever a slot was drafted; 0 / NaN mean not drafted.
        row[:, :d] = np.where(part > 0.0, np.minimum(part, 1.0), np.nan)
        if nothing_to_draft is not None:
            row[:, :d][np.asarray(nothing_to_draft, dtype=bool)[:, :d]] = 0.0
        self.history.append(row)
        # Same load next step: a threshold ready even if choose_draft_depth is not called. It is only
        # used from the next step on, so computing it from THIS step's survivals is lossless.
        depth = max(self.depth, d)
        _, _, _, thresholds, _ = self._plan(
            s.shape[0], np.array([depth]), self._pooled(self.expected_p), context_tokens
        )
        self.threshold = float(thresholds[0])

    def end_plain_step(self, num_requests: int) -> None:
        """A step without drafts: its requests join the history as not drafted (read as the expected
        acceptance), so a pessimistic step fades. Without them one suffix step where three of four
        requests had no match kept up to 25 plain steps after it (greedy edit set, c4)."""
        if num_requests > 0:
            self.history.append(np.full((int(num_requests), self.k), np.nan))

    def state(self) -> dict[str, float]:
        """Last decisions, for metrics."""
        return {
            "depth": self.depth,
            "threshold": self.threshold,
            "budget": self.budget,
            "planned_budget": self.planned_budget,
            "expected_tokens": self.expected_tokens,
            "expected_rate": self.expected_rate,
            "value_of_time": self.value_of_time,
            "gain_factor": self.gain_factor,
        }
