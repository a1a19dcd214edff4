"""Features of a draft distribution that predict whether the target will accept the drafted token.

Every feature here is a function of the draft *distribution* only, never of the token drawn from it: a
verification decision that looked at the drawn token would break lossless rejection sampling (DESIGN §5).

The main feature is `logit(q_max)`, the log-odds of the most probable token of `softmax(logits / T)`;
the estimator reads it plus a fixed shift where the distribution the draft token is drawn from (after
top-k / top-p) keeps one token only (`acceptance_feature`).
It is computed as `-log(sum_{j != argmax} exp(l_j - l_max))`, which equals `l_max - logsumexp(others)`
and never forms `1 - q_max` (that cancels to 0 in float32 once q_max > 1 - 6e-8).

Inputs are logits of shape [..., V], a torch tensor or a numpy array; results have the leading shape and
the input's kind (numpy in: float64 numpy out; torch in: float32 tensor out, float64 if the input is).
`temperature`, `top_p`, `top_k` are scalars or one value per row (shape [...]). Temperature 0 (greedy
drafting) uses 1. `top_k` 0 or -1 means no top-k cut.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

FEATURE_NAMES = ("logit_qmax", "logit_qmax_trunc", "margin_top2", "entropy", "qmax")

# |logit(q_max)| bound. Before truncation the feature is finite (q_max >= 1/V gives >= -log(V-1) ~ -12);
# the clamp only bounds near-one-hot rows, whose leverage would otherwise dominate an online fit.
DEFAULT_CLAMP = 20.0
# After top-p/top-k truncation about half of the rows are one-hot (q_max = 1, log-odds +inf): an online
# Newton fit with the clamp at 40 ran its slope to 1e7; near 10 the batch fit was well behaved.
TRUNC_CLAMP = 10.0
# Where top-k / top-p leave the draft one token (about 70 % of drafts at top-p 0.95 on the default pair)
# the drafted token is certain, and acceptance jumps above the logistic on logit(q_max) alone: measured on
# 24,131 labels (HumanEval + MT-Bench, T=1, top-p 0.95), the K + 1 fit's prequential ECE fell from 0.0121
# to 0.0075 / 0.0048 / 0.0043 / 0.0053 with a shift of 1 / 2 / 3 / 4 nats, and AUC stayed within 0.001
# of raw q_max up to 3 (the shift is monotone in q_max for a fixed top-p); 2 is the middle of the flat
# part. Greedy drafts always keep one token: for them it is a constant that the intercepts absorb.
SINGLE_TOKEN_BONUS = 2.0
# Names the estimator's input in saved estimator states, so a state fitted on another feature is noticed.
ACCEPTANCE_FEATURE_ID = f"logit_qmax+{SINGLE_TOKEN_BONUS:g}*one_token"
# Rows first look for their top-p set among this many top tokens (then 32x more, then estimate).
TOPK_BOUND = 64

ArrayLike = torch.Tensor | np.ndarray
Param = float | int | Sequence[float] | np.ndarray | torch.Tensor


def _as_rows(logits: ArrayLike) -> tuple[torch.Tensor, tuple[int, ...], bool, bool]:
    """Flatten leading dims; compute in float32 (float64 for float64 or numpy input).

    Returns (rows, leading shape, input was numpy, rows is a private copy we may overwrite).
    """
    is_numpy = isinstance(logits, np.ndarray)
    t = torch.from_numpy(np.asarray(logits, dtype=np.float64)) if is_numpy else logits.detach()
    if t.dim() == 0:
        raise ValueError("logits must have a vocabulary dimension")
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    lead = tuple(t.shape[:-1])
    rows = t.reshape(-1, t.shape[-1]).to(dtype)
    owned = not (is_numpy and logits.dtype == np.float64) and rows.data_ptr() != t.data_ptr()
    return rows, lead, is_numpy, owned


def _per_row(value: Param, n: int, dtype: torch.dtype, name: str, device: torch.device) -> torch.Tensor:
    v = torch.as_tensor(np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value), dtype=dtype)
    v = v.reshape(-1).to(device)
    if v.numel() == 1:
        return v.expand(n)
    if v.numel() != n:
        raise ValueError(f"{name} must be a scalar or one value per row ({n}), got {v.numel()} values")
    return v


def _temperatures(temperature: Param, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One temperature per row; T <= 0 (greedy drafting) counts as 1."""
    t = _per_row(temperature, n, dtype, "temperature", device)
    return torch.where(t > 0, t, torch.ones_like(t))


def _output(x: torch.Tensor, lead: tuple[int, ...], is_numpy: bool) -> ArrayLike:
    x = x.reshape(lead)
    return x.numpy().astype(np.float64) if is_numpy else x


class _Pass:
    """One pass over a batch of rows: z = logits/T - max, e = exp(z) with the max token(s) zeroed.

    The max token's mass is exp(0) == 1 exactly and every other mass is < 1, so `frac_` zeroes it in
    place, with no arg-max, mask or copy (each costs tens of ms at [64, 151936] on 2 cores). Tokens within
    3e-8 of the max count as tied, as they are to float precision; summing before and after counts ties.
    """

    def __init__(self, rows: torch.Tensor, temperature: Param, keep_z: bool = False, scratch: bool = False):
        self.t = _temperatures(temperature, rows.shape[0], rows.dtype, rows.device)
        # scratch: the caller lends `rows` as working memory, saving one [R, V] allocation.
        self.rows = None if scratch else rows
        z = rows.div_(self.t[:, None]) if scratch else rows / self.t[:, None]
        self.m = z.amax(dim=1, keepdim=True)
        z.sub_(self.m)
        e = torch.exp(z) if keep_z else z.exp_()
        self.z = z if keep_z else None
        with_max = e.sum(dim=1)
        e.frac_()
        self.e = e
        rest = e.sum(dim=1)
        self.ties = torch.round(with_max - rest)
        # The others' mass, summed without the max term: no `total - 1` cancellation near q_max = 1.
        self.others = rest + (self.ties - 1.0)

    @property
    def total(self) -> torch.Tensor:
        """Sum of exp(z) over all tokens (the max token's mass is 1)."""
        return 1.0 + self.others

    def second(self) -> torch.Tensor:
        """Mass of the second most probable token relative to the first (1 for a tie, 0 for V = 1)."""
        if self.e.shape[1] < 2:
            return torch.zeros_like(self.others)
        return torch.where(self.ties >= 2, torch.ones_like(self.others), self.e.amax(dim=1))

    def entropy(self) -> torch.Tensor:
        """H = log S - sum(e * z) / S; max tokens add 1 * 0, masked tokens (z = -inf, e = 0) add 0."""
        z = self.z.clamp_min_(torch.finfo(self.z.dtype).min)
        dot = torch.mul(self.e, z, out=z).sum(dim=1)
        self.z = None  # consumed
        return torch.log(self.total) - dot / self.total

    def truncated_others(self, top_p: Param, top_k: Param) -> torch.Tensor:
        """Mass (in units of the max token's) of the tokens other than the max that survive top-k then top-p.

        Convention (as vLLM / HF): top-k first, then top-p on the renormalised top-k distribution, keeping
        the smallest prefix of the sorted tokens whose mass reaches top_p (a token is kept iff the mass
        strictly before it is < top_p). Rows look at their top 64 tokens (at least their top-k), then at
        their top 2048; a cut beyond that is estimated (see below) instead of sorting 151,936 logits.
        """
        if self.rows is None:
            raise RuntimeError("the logits were used as scratch; the truncated feature needs them")
        n, v = self.rows.shape
        p = _per_row(top_p, n, self.rows.dtype, "top_p", self.rows.device)
        k = _per_row(top_k, n, torch.int64, "top_k", self.rows.device)
        k = torch.where((k <= 0) | (k >= v), torch.full_like(k, v), k)
        result = self.others.clone()
        todo = torch.nonzero((p < 1.0) | (k < v)).reshape(-1)
        smallest = None
        for bound in (TOPK_BOUND, 32 * TOPK_BOUND):
            if todo.numel() == 0:
                return result
            # The head holds each row's whole top-k set, whose mass renormalises the top-p cut; so every
            # row with a top-k cut is resolved here, and only top-p-only rows go on.
            cut_k = k[todo][k[todo] < v]
            width = min(v, max(bound, int(cut_k.max()) if cut_k.numel() else 0))
            src = self.rows if todo.numel() == n else self.rows[todo]
            # Rank by the raw logits (T > 0 keeps the order); only the head is exponentiated.
            head = torch.exp(src.topk(width, dim=1).values / self.t[todo, None] - self.m[todo])
            kept, resolved = _kept_others(head, self.total[todo], p[todo], k[todo])
            result[todo[resolved]] = kept[resolved]
            smallest = head[~resolved, -1]
            todo = todo[~resolved]
        if todo.numel():
            # The top-p prefix ends beyond the 2048 heaviest tokens, each later token weighs at most
            # `smallest`, so the kept mass is top_p * total plus less than one such token (< 1/2048 of
            # it): take the middle. Error in the log-odds < 2.5e-4.
            result[todo] = p[todo] * self.total[todo] - 1.0 + 0.5 * smallest
        return result


def _kept_others(
    head: torch.Tensor, total: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the descending head of each row's masses, the kept mass beyond the first token.

    Returns (kept_others, resolved): `resolved` is False where the head is too short to decide.
    """
    width = head.shape[1]
    in_k = torch.arange(width, device=head.device)[None, :] < top_k[:, None]
    head = head * in_k
    inclusive = torch.cumsum(head, dim=1)
    exclusive = inclusive - head
    k_inside = top_k <= width
    mass_k = torch.where(k_inside, inclusive[:, -1], total)  # renormaliser of the top-k distribution
    threshold = top_p * mass_k
    keep = in_k & (exclusive < threshold[:, None])
    kept = (head * keep)[:, 1:].sum(dim=1)  # the first token is always kept
    resolved = k_inside | (inclusive[:, -1] >= threshold)
    return kept, resolved


def _log_odds_from_others(others: torch.Tensor, clamp: float) -> torch.Tensor:
    # logit(q_max) = log(1 / others); others = 0 (one-hot) gives +inf before the clamp.
    return (-torch.log(others)).clamp(-clamp, clamp)


def _check_clamp(clamp: float) -> float:
    clamp = float(clamp)
    if not clamp > 0 or not np.isfinite(clamp):
        raise ValueError(f"clamp must be a positive finite number, got {clamp!r}")
    return clamp


def logit_qmax(
    logits: ArrayLike,
    temperature: Param = 1.0,
    *,
    truncated: bool = False,
    top_p: Param = 1.0,
    top_k: Param = 0,
    clamp: float | None = None,
    scratch: bool = False,
) -> ArrayLike:
    """Log-odds of the most probable token of softmax(logits / T), clamped to [-clamp, clamp].

    truncated=False (default): of the full distribution (top_p / top_k ignored), clamp 20.
    truncated=True: of the distribution after top-k then top-p truncation, clamp 10 (one-hot rows hit it).
    scratch=True lets the function overwrite a float32/float64 torch `logits` instead of copying it
    (untruncated only; saves one [R, V] allocation, ~30 ms at [64, 151936] on 2 cores); pass it for a
    tensor you no longer need. Other dtypes are converted into a private copy, which is always reused.
    """
    clamp = _check_clamp(clamp if clamp is not None else (TRUNC_CLAMP if truncated else DEFAULT_CLAMP))
    rows, lead, is_numpy, owned = _as_rows(logits)
    s = _Pass(rows, temperature, scratch=not truncated and (owned or (scratch and not is_numpy)))
    others = s.truncated_others(top_p, top_k) if truncated else s.others
    return _output(_log_odds_from_others(others, clamp), lead, is_numpy)


def margin_top2(logits: ArrayLike, temperature: Param = 1.0, *, clamp: float = DEFAULT_CLAMP) -> ArrayLike:
    """log(q_1 / q_2): the gap between the two most probable tokens in log-probability, in [0, clamp]."""
    clamp = _check_clamp(clamp)
    rows, lead, is_numpy, _ = _as_rows(logits)
    gap = -torch.log(_Pass(rows, temperature).second())
    return _output(gap.clamp(0.0, clamp), lead, is_numpy)


def entropy(logits: ArrayLike, temperature: Param = 1.0) -> ArrayLike:
    """Shannon entropy (nats) of softmax(logits / T). Higher entropy, lower acceptance."""
    rows, lead, is_numpy, _ = _as_rows(logits)
    return _output(_Pass(rows, temperature, keep_z=True).entropy(), lead, is_numpy)


def all_features(
    logits: ArrayLike,
    temperature: Param = 1.0,
    top_p: Param = 1.0,
    top_k: Param = 0,
    *,
    clamp: float = DEFAULT_CLAMP,
    trunc_clamp: float = TRUNC_CLAMP,
) -> dict[str, ArrayLike]:
    """Every feature of FEATURE_NAMES from one pass over the logits (one exp; a top-64 for truncated rows).

    "qmax" is the untruncated max probability (what "raw q_max used as a probability" means in reports);
    "logit_qmax_trunc" is clamped to `trunc_clamp` (10), the others to `clamp` (20).
    """
    clamp, trunc_clamp = _check_clamp(clamp), _check_clamp(trunc_clamp)
    rows, lead, is_numpy, _ = _as_rows(logits)
    s = _Pass(rows, temperature, keep_z=True)
    values = {
        "logit_qmax": _log_odds_from_others(s.others, clamp),
        "logit_qmax_trunc": _log_odds_from_others(s.truncated_others(top_p, top_k), trunc_clamp),
        "margin_top2": (-torch.log(s.second())).clamp(0.0, clamp),
        "entropy": s.entropy(),
        "qmax": 1.0 / s.total,
    }
    return {name: _output(v, lead, is_numpy) for name, v in values.items()}


def keeps_one_token(probs) -> torch.Tensor:
    """Rows of sampling distributions (after temperature, top-k, top-p; greedy rows one-hot), a
    `SparseRows` or a dense [N, V] tensor, that put all their mass on one token."""
    if isinstance(probs, torch.Tensor):
        return probs.amax(dim=-1) >= 1.0  # a single kept token renormalises to exactly 1.0
    return probs.counts() == 1


def acceptance_feature(
    logit_qmax: ArrayLike, one_token: ArrayLike, bonus: float = SINGLE_TOKEN_BONUS
) -> np.ndarray:
    """The estimator's input: logit(q_max) before truncation, plus `bonus` where the draft distribution
    the token is drawn from keeps one token (`keeps_one_token`). NaN (an undrafted slot) stays NaN."""
    x = np.asarray(logit_qmax.cpu() if isinstance(logit_qmax, torch.Tensor) else logit_qmax, np.float64)
    one = np.asarray(one_token.cpu() if isinstance(one_token, torch.Tensor) else one_token, np.float64)
    return x + float(bonus) * one
