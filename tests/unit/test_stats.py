"""The experiment statistics (minirl.experiments.stats) on constructed cases with known answers."""

from __future__ import annotations

import math

import pytest

from minirl.experiments.stats import difficulty_skew, mean_ci, paired_ci, rooms_mix, t_cdf, t_ppf


@pytest.mark.parametrize("df,q", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423), (1e6, 1.95997)])
def test_t_quantiles_match_the_tables(df, q):
    assert t_ppf(0.975, df) == pytest.approx(q, abs=2e-4)


def test_t_cdf_agrees_with_the_integrated_density():
    for df in (1.5, 3, 7.3):
        c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
        pdf = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
        for t in (0.3, 1.0, 2.5):
            n = 2000  # Simpson on [0, t], plus the half below 0
            h = t / n
            area = pdf(0) + pdf(t) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n))
            assert t_cdf(t, df) == pytest.approx(0.5 + area * h / 3, abs=1e-7)
            assert t_cdf(-t, df) == pytest.approx(1 - t_cdf(t, df), abs=1e-12)


def test_mean_ci_and_paired_differences():
    mean, half = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3 and half == pytest.approx(2.7764 * math.sqrt(2.5) / math.sqrt(5), abs=1e-3)
    assert math.isnan(mean_ci([0.4])[1])
    # seeds differ far more than the policies do: unpaired, 0.1 is lost in a spread of 0.4; paired,
    # the differences 0.1, 0.12, 0.08 give 0.10 +- t(2) * 0.02 / sqrt(3)
    a = {0: 0.30, 1: 0.72, 2: 0.48}
    b = {0: 0.20, 1: 0.60, 2: 0.40, 3: 0.9}  # seed 3 has no partner
    m, h, n = paired_ci(a, b)
    assert n == 3 and m == pytest.approx(0.10) and h == pytest.approx(4.3027 * 0.02 / math.sqrt(3), abs=1e-4)
    assert m - h > 0 and mean_ci(list(a.values()))[1] > 0.5  # resolved paired, not unpaired
    assert paired_ci(a, {**b, 2: float("nan")})[2] == 2  # a nan drops its pair
    assert math.isnan(paired_ci({0: 1.0}, {0: 0.5})[1]) and paired_ci({0: 1.0}, {1: 0.5})[2] == 0


def test_skew_of_a_policy_that_loses_hard_prompts():
    """2 steps x 4 groups x 2 rollouts; groups 0-1 have 1 room, groups 2-3 have 4 rooms. Step 0
    drops group 2, step 1 masks one rollout of group 3; a raised drop, a retried failure and the
    events of a step that did not complete change nothing."""
    events = [
        {"type": "drop", "step": 0, "group": 2, "decision": "dropped"},
        {"type": "failure", "step": 0, "group": 3, "rollout": 0, "decision": "retried"},
        {"type": "mask", "step": 1, "group": 3, "rollout": 1},
        {"type": "drop", "step": 2, "group": 0, "decision": "dropped"},
        {"type": "failure", "step": 2, "group": 1, "rollout": 0, "decision": "skipped"},
        {"type": "run_failed", "step": 2},
    ]
    dispatched, trained = rooms_mix(lambda s, g: 1 if g < 2 else 4, 2, 4, 2, events)
    assert dispatched == {1: 8, 4: 8} and trained == {1: 8, 4: 5}
    skew = difficulty_skew(dispatched, trained)
    assert skew["skew_tv"] == pytest.approx(3 / 26)
    assert skew["rooms_dispatched_mean"] == 2.5 and skew["rooms_trained_mean"] == pytest.approx(28 / 13)
    assert skew["rooms_shift"] == pytest.approx(28 / 13 - 2.5) and skew["rooms_shift"] < 0
    # a skipped group counts like a drop; nothing lost is no skew
    _, t2 = rooms_mix(lambda s, g: 1 if g < 2 else 4, 3, 4, 2, events)
    assert t2[1] == 8 + 0 and difficulty_skew({1: 4, 3: 4}, {1: 2, 3: 2})["skew_tv"] == 0
    assert math.isnan(difficulty_skew({1: 4}, {})["skew_tv"])


def test_an_event_without_a_step_is_skipped():
    """cluster._run_failed writes `"step": null` when the controller does not answer: the mixes skip it
    (it names no step), rather than comparing None with the step count and ending the whole sweep."""
    events = [{"type": "drop", "step": 0, "group": 2, "decision": "dropped"},
              {"type": "run_failed", "step": None, "error": "RayActorError: controller died"},
              {"type": "mask", "step": None, "group": 3}, {"type": "mask", "group": 3}]
    dispatched, trained = rooms_mix(lambda s, g: 1 if g < 2 else 4, 1, 4, 2, events)
    assert dispatched == {1: 4, 4: 4} and trained == {1: 4, 4: 2}


def test_the_estimates_plot_draws_no_interval_where_there_is_none():
    """One seed (no half-width) or seeds all alike (spreadless) is a hollow point labelled '(no interval)',
    not an error bar of zero width that reads as certainty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minirl.experiments.estimates import Estimate
    from minirl.experiments.plots import _estimates

    ests = [Estimate("val one seed", 0.1, math.nan, 1), Estimate("val alike", 0.125, 0.0, 2),
            Estimate("val spread", 0.1, 0.05, 3)]
    fig = _estimates(plt, ests, "timeout", 0.1)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["val one seed (no interval)", "val alike (no interval)", "val spread"]
    assert len(ax.containers) == 1  # one errorbar: the estimate with a spread
    assert ax.containers[0].lines[0].get_xdata()[0] == 0.1
    plt.close(fig)


def test_redispatch_avoids_the_skew_only_where_its_own_skew_holds_0():
    """Found by review: seeds that all gave the same nonzero skew (no spread, so no interval) were read as
    holding 0, and "Does redispatch avoid the skew?" answered Yes for a policy that skews in every seed."""
    from minirl.experiments.estimates import Estimate
    from minirl.experiments.questions import _redispatch

    def rows(shifts):
        return [{"seed": s, "rooms_shift": v, "groups_redispatched": 1.0, "groups_dropped": 0.0, "rollouts_masked": 0.0}
                for s, v in enumerate(shifts)]

    shrink = rows([-1.0, -1.2, -0.9])  # skews resolvably further than either redispatch below
    for own, answer in (([-0.5] * 3, "**Not resolvably**"), ([0.0] * 3, "**Yes**"), ([-0.4, 0.1, 0.2], "**Yes**")):
        here = {"+redispatch": rows(own), "+shrink": shrink}
        mean, half = sum(own) / 3, 0.0 if len(set(own)) == 1 else 1.0
        _, lines, _ = _redispatch(here, {"+redispatch": Estimate("skew", mean, half, 3)})
        assert lines[0].startswith(answer), (own, lines[0])
