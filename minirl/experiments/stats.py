"""Statistics of experiments, as pure functions: Student-t intervals over seeds, paired differences
between two policies (`paired_ci`), and the difficulty skew of what a failure policy trains
(`difficulty_skew`, over mixes recomputed from the prompt stream and a run's events).

Invariant: every function here is deterministic and reads only its arguments.
"""

from __future__ import annotations

import math
from collections import Counter


# ----------------------------------------------------------------------------------------- t tests
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t > 0 else tail


def t_ppf(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on t_cdf), for 0.5 <= p < 1."""
    lo, hi = 0.0, 1e7
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def mean_ci(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of the t-interval); the half-width is nan below two values."""
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(xs) / n
    if n < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean, t_ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)


def paired_ci(a: dict, b: dict, level: float = 0.95) -> tuple[float, float, int]:
    """(mean of a[s] - b[s], half-width of its t-interval, number of pairs) over the keys (seeds)
    present in both with a value that is not nan.

    Within one seed every policy of a sweep meets the same prompts, the same held-out set and the
    same fault draws (minirl.faults), so two policies are compared by their per-seed differences; an
    interval that excludes 0 is a paired t-test at the same level. The seed-to-seed spread of the
    prompts cancels out of a difference, which an unpaired test (e.g. Welch's) would count as noise."""
    diffs = [a[k] - b[k] for k in sorted(set(a) & set(b)) if not (math.isnan(a[k]) or math.isnan(b[k]))]
    return (*mean_ci(diffs, level), len(diffs))


# ------------------------------------------------------------------------------------------- skew
def difficulty_skew(dispatched: dict[int, float], trained: dict[int, float]) -> dict:
    """TV distance between the two room-count mixes, and their means (nan where a mix is empty).

    For a run, `dispatched[k]` counts the rollouts dispatched for prompts with k rooms (G per prompt
    group of every completed step), and `trained[k]` the rollouts of k-room prompts that reached the
    optimizer with weight (in a kept group and not masked). A policy that drops or masks the
    failures of hard prompts trains on an easier mix than it dispatched: a total-variation distance
    TV = 1/2 sum_k |trained_k / T - dispatched_k / D| above 0, and a mean room count trained below
    the one dispatched. Both mixes are recomputed (`rooms_mix`, `group_fates`) from the prompt stream
    (minirl.data, a pure function of (step, group)) and the run's events (drops, skips and masks,
    with their coordinates), so no component has to report them."""
    d, t = sum(dispatched.values()), sum(trained.values())
    keys = set(dispatched) | set(trained)
    mean_d = sum(k * v for k, v in dispatched.items()) / d if d else float("nan")
    mean_t = sum(k * v for k, v in trained.items()) / t if t else float("nan")
    tv = 0.5 * sum(abs(trained.get(k, 0) / t - dispatched.get(k, 0) / d) for k in keys) if d and t else float("nan")
    return {"skew_tv": tv, "rooms_dispatched_mean": mean_d, "rooms_trained_mean": mean_t,
            "rooms_shift": mean_t - mean_d}


def rooms_mix(rooms_of, steps: int, groups: int, generations: int, events: list[dict]) -> tuple[Counter, Counter]:
    """(dispatched, trained) rollout counts by room count over `steps` completed steps.

    `rooms_of(step, group)` gives a prompt's room count; `events` are the run's events.jsonl lines:
    a `drop` event (decision `dropped`) or a `failure` event with decision `skipped` removes its
    group, and a `mask` event removes one rollout of a kept group. Only the events of a completed step
    count: an event without an integer step (cluster._run_failed writes `"step": null` when the
    controller does not answer) names none and is skipped."""
    done = [e for e in events if isinstance(e.get("step"), int) and e["step"] < steps]
    gone = {(e["step"], e["group"]) for e in done if (e.get("type") == "drop" and e.get("decision") == "dropped")
            or (e.get("type") == "failure" and e.get("decision") == "skipped")}
    masked = Counter((e["step"], e["group"]) for e in done if e.get("type") == "mask")
    dispatched, trained = Counter(), Counter()
    for s in range(steps):
        for g in range(groups):
            k = rooms_of(s, g)
            dispatched[k] += generations
            if (s, g) not in gone:
                trained[k] += generations - masked[(s, g)]
    return dispatched, trained


FATES = ("trained", "evicted", "dropped", "unresolved")


def group_fates(rooms_of, dispatched: list[tuple[int, int]], trained: list[tuple[int, int]], generations: int,
                events: list[dict]) -> dict[str, Counter]:
    """Per room count, the fate of every dispatched prompt group of a run, sync or async.

    `dispatched`: the (step, group) coordinates dispatched (async: the run's `dispatch` events; sync:
    every group of the completed steps); `trained`: those some step took (async: the steps'
    `prompt_seeds` mapped back to coordinates). A group is `evicted` (an `evict` event: it fell out of
    the staleness window), else `dropped` (a `drop` or skipped `failure` event), else `trained`, else
    `unresolved` (in flight or buffered when the run ended: neither trained nor thrown away). Returns
    Counters by room count of groups `dispatched` and of each fate, and of rollouts `resolved` (G per
    group that met a fate) and `rollouts_trained` (G less the masked, per trained group): the mixes
    that `difficulty_skew` compares, so a group still in flight at the end counts in neither."""
    evicted = {(e["step"], e["group"]) for e in events if e.get("type") == "evict"}
    dropped = {(e["step"], e["group"]) for e in events if (e.get("type") == "drop" and e.get("decision") == "dropped")
               or (e.get("type") == "failure" and e.get("decision") == "skipped")}
    masked = Counter((e["step"], e["group"]) for e in events if e.get("type") == "mask")
    took = set(trained)
    out = {k: Counter() for k in ("dispatched", *FATES, "resolved", "rollouts_trained")}
    for c in dict.fromkeys(dispatched):
        k = rooms_of(*c)
        fate = "evicted" if c in evicted else "dropped" if c in dropped else "trained" if c in took else "unresolved"
        out["dispatched"][k] += 1
        out[fate][k] += 1
        if fate != "unresolved":
            out["resolved"][k] += generations
        if fate == "trained":
            out["rollouts_trained"][k] += generations - masked[c]
    return out
