"""Robust aggregation of one part of the all-reduce: what a reducer makes of its senders' parts.

A reducer of the butterfly all-reduce (``allreduce.py``) holds, for each part of its slice, one
vector per sender: ``parts`` ``[n_senders, part_numel]`` fp32 with ``weights`` ``[n_senders]`` (the
senders' tokens). The plain weighted mean lets one hostile sender move the result anywhere within
the size bound its part passes (a Δ of −8× its own moved a 5-peer run's held-out loss by +21.5%,
issue 37). :func:`skipped_mean` is the rule the reducer uses; :func:`centered_clip`,
:func:`trimmed_mean` and :func:`coordinate_median` are the candidates it was measured against
(``bench.quality``, ``bench.hostile``; docs/decisions.md, *Robust aggregation*).

**The skipped mean** (Hampel, "The breakdown points of the mean combined with some rejection
rules", Technometrics 27(2), 1985; here in L2 over a part, re-centred on the parts it keeps)::

    v  = the coordinate-wise median of the parts
    τ  = TAU_FACTOR × the median over senders of ‖xᵢ − v‖
    K  = {i : devᵢ(v) ≤ τ};  v ← the mean of the parts in K;  again until K stays the same
    result = Σ_K wᵢ xᵢ / Σ_K wᵢ

where ``devᵢ(v)`` is ‖xᵢ − v‖ less a step further along v's own direction of up to
``(rᵢ − 1) · ‖v‖``, ``rᵢ`` = the sender's capped weight over the median weight, at least 1
(:func:`deviations`): a peer whose DyLU phase was 2H where the median was H/2 (``node/dylu.py``)
carries about 4× the centre, honestly. A deviation against the centre or across it counts in full,
whatever weight the sender claims.

A part farther than τ (an outlier) is left out; the others are averaged with their weights. Honest
parts of equal phases lie within a few median distances, so none is left out and the result is
exactly their weighted mean; a small part (hivemind makes each tensor below its part size one part, so
a LayerNorm gain of a few hundred values is one) now and then lies past τ, and that one sender's part
of that tensor is left out of that round (docs/decisions.md, *Robust aggregation*). An outlier pulls the result by nothing; a hostile part placed just
inside τ by at most ``wᵢ · τ / Σ w``. −8 × Δ lies about 8 × ‖Δ‖ from the centre, against it: left out.
Where phases differ (H/4 to 2H) the median distance grows with the long phases' Δs, so a small
peer's −8 × Δ may pass; it then moves the result by less than a long phase does
(docs/decisions.md, *Robust aggregation*, with the shares measured).

The centre, the median and τ count senders, not tokens (one sender, one vote), so fewer than half
of the senders can move neither the centre nor τ, whatever weight they claim; the tokens weigh
only the parts kept, capped at ``WEIGHT_CAP`` × their median. With two senders no rule can tell
which one is wrong: both are equally far from their median, and the result is the weighted mean.
Robustness starts at 3 senders (1 hostile of 3) and holds for fewer than half of them.

**CenteredClip** (Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust
Optimization", arXiv 2012.10333; run inside a butterfly all-reduce by BTARD, Gorbunov et al., arXiv
2106.11257) clips each part's distance to the centre at τ instead of leaving it out: a far part
keeps a pull of ``wᵢ · τ / Σ w`` in every round (its cost against the skipped mean's: ``bench.hostile``,
docs/benchmarks.md section 10).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TAU_FACTOR = 6.0  # the skipped mean's τ, in median distances: honest equal phases lay within 4.3 (bench.hostile)
CLIP_TAU_FACTOR = 3.0  # CenteredClip's τ (a candidate): honest parts of equal phases lay within 2.8
MAX_ITERATIONS = 10  # re-centrings of the skipped mean, steps of CenteredClip; both settle within a few
STOP_FRACTION = 1e-3  # CenteredClip stops once a step moves the centre by less than this share of τ
WEIGHT_CAP = 4.0  # a weight counts at most this many times the median weight: DyLU phases span [H/4, 2H], a carried Δ 2 phases
TRIM_FRACTION = 0.2  # trimmed_mean drops this share of the senders at each end, per coordinate (at least one)
MIN_ROBUST_SENDERS = 3  # below this, every rule here is the weighted mean


@dataclass
class RobustAverage:
    """One part's robust aggregate.

    :param value: the aggregate, fp32, ``[part_numel]``.
    :param outliers: per sender (the rows of ``parts``): True when its part lay farther than τ from
        the centre (the skipped mean left it out; CenteredClip cut its pull); all False for the
        weighted mean.
    :param tau: the radius τ (L2 over the part; 0.0 when the rule did not need one).
    :param iterations: re-centrings or CenteredClip steps taken (0: the weighted mean at once).
    """

    value: torch.Tensor
    outliers: list[bool]
    tau: float = 0.0
    iterations: int = 0


def _check(parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weights`` as a float64 vector after checking both arguments. :raises ValueError: bad shapes or weights."""
    if parts.dim() != 2 or parts.dtype != torch.float32:
        raise ValueError(f"parts must be a [n_senders, part_numel] float32 tensor, got {tuple(parts.shape)} "
                         f"{parts.dtype}")
    w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
    if w.numel() != parts.shape[0]:
        raise ValueError(f"{w.numel()} weights for {parts.shape[0]} parts")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weights must be finite and non-negative")
    return w


def weighted_mean(parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ wᵢ xᵢ / Σ wᵢ over the rows of ``parts`` ``[n, d]`` fp32 (zeros when no weight): what
    hivemind's ``TensorPartReducer`` computes, in fp32."""
    w = _check(parts, weights)
    total = float(w.sum())
    if parts.shape[0] == 0 or total <= 0.0:
        return torch.zeros(parts.shape[1], dtype=torch.float32)
    return (w / total).to(torch.float32) @ parts


def capped_weights(weights: torch.Tensor) -> torch.Tensor:
    """``weights`` (float64 ``[n]``) with each one at most ``WEIGHT_CAP`` × their median (the lower one
    for an even count, as ``torch.median``): a sender's claimed tokens are untrusted."""
    if weights.numel() < MIN_ROBUST_SENDERS:
        return weights
    return weights.clamp(max=WEIGHT_CAP * float(weights.median()))


def _start(parts: torch.Tensor, tau_factor: float) -> tuple[torch.Tensor, float]:
    """(the coordinate-wise median of ``parts``, τ = ``tau_factor`` × the median distance of the parts to it)."""
    v = parts.median(dim=0).values
    return v, tau_factor * float(torch.linalg.vector_norm(parts - v, dim=1).median())


def reach(weights: torch.Tensor) -> torch.Tensor:
    """Each sender's capped weight over the median weight, at least 1 (float64 ``[n]`` from ``weights`` float64
    ``[n]``, all positive): how many median phases' worth of Δ it may carry along the centre's direction."""
    capped = capped_weights(weights)
    return (capped / float(capped.median())).clamp(min=1.0)


def deviations(parts: torch.Tensor, centre: torch.Tensor, reaches: torch.Tensor) -> torch.Tensor:
    """How far each row of ``parts`` ``[n, d]`` lies from ``centre`` ``[d]``, forgiving a step further along the
    centre's own direction of up to ``(reach − 1) × ‖centre‖`` (``reaches`` ``[n]``): a sender that trained k× the
    median tokens carries about k× the centre (DyLU phases span H/4 to 2H, ``node/dylu.py``). A deviation against
    the centre or across it counts in full. :returns: ``[n]`` fp32, L2 over the part."""
    diff = parts - centre
    norm = float(torch.linalg.vector_norm(centre))
    if norm == 0.0:
        return torch.linalg.vector_norm(diff, dim=1)
    unit = centre / norm
    along = diff @ unit  # [n]
    forgiven = torch.minimum(along.clamp(min=0.0), (reaches.to(torch.float32) - 1.0) * norm)
    return torch.linalg.vector_norm(diff - forgiven[:, None] * unit, dim=1)


def skipped_mean(parts: torch.Tensor, weights: torch.Tensor, *, tau_factor: float = TAU_FACTOR) -> RobustAverage:
    """The reducers' rule: the weighted mean of the parts whose :func:`deviations` from the kept parts' centre
    stay within τ (module docstring; Hampel 1985).

    :param parts: ``[n_senders, part_numel]`` float32, finite (the reducer checked them).
    :param weights: ``[n_senders]`` non-negative (tokens); capped by :func:`capped_weights`, they weigh the parts
        kept and let a part lie further along the centre (:func:`reach`), and never move the centre or τ. A
        sender of weight 0 adds nothing and is not judged.
    :param tau_factor: τ as a multiple of the median distance of the parts to their coordinate-wise median.
    :returns: the aggregate and the senders left out (``outliers``). Fewer than ``MIN_ROBUST_SENDERS``
        senders of positive weight, or none left out: their weighted mean.
    :raises ValueError: bad shapes, dtype or weights.
    """
    w = _check(parts, weights)
    n = parts.shape[0]
    judged = (w > 0).nonzero().reshape(-1)
    if judged.numel() < MIN_ROBUST_SENDERS:
        return RobustAverage(weighted_mean(parts, w), [False] * n)
    x, wj = parts[judged], w[judged]
    v, tau = _start(x, tau_factor)
    if not tau > 0.0:  # more than half the parts equal the median: nothing to measure against
        return RobustAverage(weighted_mean(parts, w), [False] * n)
    reaches = reach(wj)
    kept, iterations = None, 0
    for iterations in range(1, MAX_ITERATIONS + 1):
        inside = deviations(x, v, reaches) <= tau
        if kept is not None and torch.equal(inside, kept):
            break
        kept = inside
        if not bool(kept.any()):  # nobody near the median: a hostile majority, or no structure at all
            break
        v = x[kept].mean(dim=0)
    outliers = [False] * n
    for index, out in zip(judged.tolist(), (~kept).tolist()):
        outliers[index] = out
    if not bool(kept.any()):
        return RobustAverage(v, outliers, tau, iterations)
    capped = capped_weights(wj)
    value = weighted_mean(x, capped) if bool(kept.all()) else weighted_mean(x[kept], capped[kept])
    return RobustAverage(value, outliers, tau, iterations)


def centered_clip(parts: torch.Tensor, weights: torch.Tensor, *, tau_factor: float = CLIP_TAU_FACTOR,
                  max_iterations: int = MAX_ITERATIONS) -> RobustAverage:
    """Weighted CenteredClip of the rows of ``parts`` (a candidate; arXiv 2012.10333, 2106.11257)::

        v ← v + Σ wᵢ · clip(xᵢ − v, τ) / Σ wᵢ,   clip(u, τ) = u · min(1, τ / ‖u‖)

    from the coordinate-wise median, τ as in :func:`skipped_mean`, until no part is clipped (one more
    step lands on the weighted mean itself) or ``v`` moves less than ``STOP_FRACTION`` × τ.

    :param parts: ``[n_senders, part_numel]`` float32, finite.
    :param weights: ``[n_senders]`` non-negative (tokens), capped by :func:`capped_weights`.
    :param tau_factor: τ as a multiple of the median distance of the parts to their coordinate-wise median.
    :param max_iterations: most CenteredClip steps.
    :returns: the aggregate and which senders were clipped at the end. Fewer than
        ``MIN_ROBUST_SENDERS`` parts, or parts all equal to their median: the weighted mean.
    :raises ValueError: bad shapes, dtype or weights.
    """
    w = _check(parts, weights)
    n = parts.shape[0]
    if n < MIN_ROBUST_SENDERS or float(w.sum()) <= 0.0:
        return RobustAverage(weighted_mean(parts, w), [False] * n)
    share = (capped_weights(w) / capped_weights(w).sum()).to(torch.float32)  # [n]
    v, tau = _start(parts, tau_factor)
    if not tau > 0.0:
        return RobustAverage(weighted_mean(parts, w), [False] * n)
    iterations = 0
    for iterations in range(1, max_iterations + 1):
        diff = parts - v
        scale = (tau / torch.linalg.vector_norm(diff, dim=1).clamp_min(1e-30)).clamp(max=1.0)
        if bool((scale >= 1.0).all()):  # nobody clipped: the step lands on the weighted mean itself
            return RobustAverage(share @ parts, [False] * n, tau, iterations)
        step = (share * scale) @ diff
        v = v + step
        if float(torch.linalg.vector_norm(step)) <= STOP_FRACTION * tau:
            break
    return RobustAverage(v, (torch.linalg.vector_norm(parts - v, dim=1) > tau).tolist(), tau, iterations)


def trimmed_mean(parts: torch.Tensor, weights: torch.Tensor, trim_fraction: float = TRIM_FRACTION) -> torch.Tensor:
    """Coordinate-wise weighted trimmed mean (a candidate): per coordinate, drop the
    ``max(1, ⌊trim_fraction·n⌋)`` smallest and largest of the ``n`` values and take the weighted mean of
    the rest (Yin et al., arXiv 1803.01498). ``parts`` ``[n, d]`` fp32, ``weights`` ``[n]``; fewer than
    ``MIN_ROBUST_SENDERS`` parts: the weighted mean. :returns: ``[d]`` fp32."""
    w = _check(parts, weights)
    n = parts.shape[0]
    if n < MIN_ROBUST_SENDERS:
        return weighted_mean(parts, w)
    b = max(1, int(trim_fraction * n))
    if n - 2 * b < 1:
        b = (n - 1) // 2
    values, order = parts.sort(dim=0)
    kept_w = capped_weights(w).to(torch.float32)[order[b:n - b]]  # [n - 2b, d]
    return (values[b:n - b] * kept_w).sum(dim=0) / kept_w.sum(dim=0).clamp_min(1e-30)


def coordinate_median(parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise weighted median (a candidate): per coordinate the smallest value whose cumulative
    weight (values in ascending order) reaches half the total (Yin et al., arXiv 1803.01498). ``parts``
    ``[n, d]`` fp32, ``weights`` ``[n]``; fewer than ``MIN_ROBUST_SENDERS`` parts: the weighted mean.
    :returns: ``[d]`` fp32."""
    w = _check(parts, weights)
    if parts.shape[0] < MIN_ROBUST_SENDERS:
        return weighted_mean(parts, w)
    values, order = parts.sort(dim=0)
    cw = capped_weights(w)[order].cumsum(dim=0)  # [n, d] float64
    index = (cw < cw[-1:] / 2).sum(dim=0, keepdim=True).clamp(max=parts.shape[0] - 1)
    return values.gather(0, index).reshape(-1)


RULES = {"mean": weighted_mean, "skipped-mean": lambda parts, weights: skipped_mean(parts, weights).value,
         "centered-clip": lambda parts, weights: centered_clip(parts, weights).value,
         "trimmed-mean": trimmed_mean, "median": coordinate_median}
"""The rules by name, each ``(parts [n, d] fp32, weights [n]) -> [d] fp32``: for the benchmarks."""
