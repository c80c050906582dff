"""The sweep's four questions (does shrink's dropping skew training toward easy prompts, does
end_episode's masking, does redispatch avoid it, does `grpo.baseline_excludes_masked` change the
outcome) and the pick per fault mode, answered from the estimates. Invariant: an answer says Yes or
No only where its estimate's interval excludes 0; otherwise it says not resolvable. A skew is a room
count trained minus dispatched (negative: an easier mix), and a gap `p − q` is p's skew less q's, paired
by seed."""

from __future__ import annotations

from minirl.experiments.estimates import Estimate, _ci, _level, _mean, _paired, _rate, cell_name
from minirl.experiments.grid import DEFAULTS, MASKED_IN_BASELINE, MASKED_REWARDS, Grid

Question = tuple[str, list[str], list[Estimate]]
"""(question, answer lines, the estimates drawn in four_questions.png)"""


def four_questions(here: dict[str, list[dict]]) -> list[Question]:
    """Issue M's questions, each as (question, answer lines, the estimates drawn in four_questions.png),
    for the policies of one mode and rate that the grid ran; a question whose policies are missing
    is left out."""
    shift = {p: _level(rs, "rooms_shift", f"{p}: rooms trained − dispatched") for p, rs in here.items()}
    asked = (_shrink(here, shift), _end_episode(here, shift), _redispatch(here, shift), _baseline_flag(here),
             _third_baseline(here))
    return [q for q in asked if q is not None]


def _skew_answer(here: dict[str, list[dict]], shift: dict[str, Estimate], p: str,
                 what: str) -> tuple[list[str], list[Estimate]]:
    rs, e = here[p], shift[p]
    ans = {-1: "**Yes**", 1: "**No, toward hard prompts**", 0: "**Not resolvable**"}[e.sign]
    lines = [f"{ans}. {p} {what} and trained {e.resolved()} rooms against the mix dispatched "
             f"(TV distance {_ci(rs, 'skew_tv')}); it trained {_ci(rs, 'fraction_trained')} of the rollouts "
             "returned."]
    died = [r for r in rs if not r["survived"]]
    if died:
        steps = ", ".join(str(r["died_at_step"]) for r in died)
        lines.append(f"{len(died)} of {len(rs)} runs died (at step {steps}): "
                     "their skew covers the steps they completed, their final validation is the last they reached.")
    if "+redispatch" not in here:
        return lines, [e]
    v = _paired(here[p], here["+redispatch"], "val_reward_final", f"val reward: {p} − +redispatch")
    return lines + [f"Its final held-out reward against +redispatch, paired by seed: {v.resolved()}."], [e, v]


def _shrink(here: dict[str, list[dict]], shift: dict[str, Estimate]) -> Question | None:
    if "+shrink" not in here:
        return None
    rs = here["+shrink"]
    return ("Does dropping under shrink skew training toward easy prompts?",
            *_skew_answer(here, shift, "+shrink", f"dropped {_mean(rs, 'groups_dropped'):.1f} groups a run "
                          "(mean over seeds)"))


def _end_episode(here: dict[str, list[dict]], shift: dict[str, Estimate]) -> Question | None:
    if "+end_episode" not in here:
        return None
    rs = here["+end_episode"]
    lines, ests = _skew_answer(here, shift, "+end_episode", f"masked {_mean(rs, 'rollouts_masked'):.1f} rollouts "
                               f"a run of {_mean(rs, 'rollouts_generated'):.0f}")
    if DEFAULTS in here:  # the shipped config masks guard rejections too
        lines.append(f"{DEFAULTS} (end_episode on) trained {shift[DEFAULTS].resolved()} rooms against dispatched.")
        ests.append(shift[DEFAULTS])
    return "Does masking under end_episode skew it?", lines, ests


def _redispatch(here: dict[str, list[dict]], shift: dict[str, Estimate]) -> Question | None:
    if "+redispatch" not in here:
        return None
    rs, e = here["+redispatch"], shift["+redispatch"]
    gaps = [_paired(here[p], rs, "rooms_shift", f"skew: {p} − +redispatch")
            for p in ("+shrink", "+end_episode", DEFAULTS) if p in here]
    # Yes: its own skew holds 0 and every other policy skews resolvably further toward easy prompts than it does;
    # seeds without spread, or one seed, hold 0 only if it is 0 (no interval says so otherwise)
    holds_zero = e.sign == 0 and (e.mean == 0 or not (e.spreadless or e.half != e.half))
    avoids = holds_zero and bool(gaps) and all(g.sign < 0 for g in gaps)
    ans = "**No**" if e.sign else "**Yes**" if avoids else "**Not resolvably**"
    lines = [f"{ans}. +redispatch re-sent {_mean(rs, 'groups_redispatched'):.1f} groups a run, dropped "
             f"{_mean(rs, 'groups_dropped'):.1f} and masked {_mean(rs, 'rollouts_masked'):.1f}; it trained "
             f"{e.resolved()} rooms against dispatched."]
    lines += [f"Skew of {g.label.split(': ')[1]}, paired by seed: {g.resolved()}." for g in gaps]
    return "Does redispatch avoid the skew?", lines, [e, *gaps]


def _baseline_pair(twin: str, inert: bool) -> str:
    """What separates the two policies compared for the baseline flag."""
    if twin == MASKED_IN_BASELINE:
        return f"The two runs of a seed differ only in the flag (true in {DEFAULTS}, false in its twin)."
    if inert:
        return (f"{DEFAULTS} (flag true) and +end_episode (the upstream preset with masking, flag false, as in "
                "configs/upstream_pr4124.yaml) also differ in fixes 1 and 3 and the budgets, but those never "
                "acted: neither policy dropped or re-sent a group in any seed. So the pair isolates the flag.")
    return (f"{DEFAULTS} and +end_episode differ in more than the flag here (some seed dropped or re-sent a "
            f"group): run `{MASKED_IN_BASELINE}` to isolate it.")


def _baseline_flag(here: dict[str, list[dict]]) -> Question | None:
    twin = next((p for p in (MASKED_IN_BASELINE, "+end_episode") if p in here), None)
    if DEFAULTS not in here or not twin:  # flag true against flag false, both masking
        return None
    a, b = here[DEFAULTS], here[twin]
    unmasked = [p for p, rs in here.items() if all(r["rollouts_masked"] == 0 for r in rs)]
    inert = all(r["groups_dropped"] == 0 and r["groups_redispatched"] == 0 for r in a + b)
    v = _paired(a, b, "val_reward_final", f"val reward: {DEFAULTS} − {twin}")
    succ = _paired(a, b, "val_success_final", f"val success: {DEFAULTS} − {twin}")
    sk = _paired(a, b, "rooms_shift", f"skew: {DEFAULTS} − {twin}")
    ans = ("**Not isolated**" if twin != MASKED_IN_BASELINE and not inert else
           "**Not resolvably**" if v.sign == 0 and succ.sign == 0 else "**Yes**")
    lines = [f"{ans}. {_baseline_pair(twin, inert)} Both runs of a seed meet the same prompts and faults; they "
             f"masked {_mean(a, 'rollouts_masked'):.1f} and {_mean(b, 'rollouts_masked'):.1f} rollouts a run. The "
             "flag acts only on the advantages of groups with a masked rollout, so masking is where it can matter"
             + (f" (it does nothing under {', '.join(unmasked)}, which masked no rollout in any seed)."
                if unmasked else "."),
             f"Final held-out reward (true − false), paired by seed: {v.resolved()}; "
             f"success rate: {succ.resolved()}.",
             f"Skew (true − false): {sk.resolved()}: the flag cannot change which rollouts are masked, only "
             "how the unmasked ones are weighted."]
    ests = [v, succ]
    if twin == MASKED_IN_BASELINE and "+end_episode" in here:
        w = _paired(a, here["+end_episode"], "val_reward_final", f"val reward: {DEFAULTS} − +end_episode")
        lines.append(f"The same against +end_episode (the upstream preset with masking, flag false): "
                     f"{w.resolved()}.")
        ests.append(w)
    return "Does `grpo.baseline_excludes_masked` change the outcome?", lines, ests


def _third_baseline(here: dict[str, list[dict]]) -> Question | None:
    """NeMo's third policy (`grpo.masked_sample_rewards_in_baseline`) against the two others, paired by seed:
    final held-out reward and success, and the trained-difficulty skew."""
    if MASKED_REWARDS not in here:
        return None
    a, lines, ests = here[MASKED_REWARDS], [], []
    for other, flag in ((DEFAULTS, "masked rows out of the baseline"), (MASKED_IN_BASELINE, "every masked row in it")):
        if other not in here:
            continue
        v = _paired(a, here[other], "val_reward_final", f"val reward: third − {other}")
        succ = _paired(a, here[other], "val_success_final", f"val success: third − {other}")
        sk = _paired(a, here[other], "rooms_shift", f"skew: third − {other}")
        lines.append(f"Against {other} ({flag}): final held-out reward {v.resolved()}, success {succ.resolved()}, "
                     f"skew {sk.resolved()}.")
        ests += [v, succ, sk]
    lines.append(f"The third policy keeps an environment-flagged or truncated row's reward in its siblings' baseline "
                 f"and a placeholder's out; its runs masked {_mean(a, 'rollouts_masked'):.1f} rollouts a run.")
    ans = "**Yes**" if any(e.sign != 0 for e in ests[:2] + ests[3:5]) else "**Not resolvably**"
    return "Does NeMo's third baseline policy change the outcome?", [f"{ans}. " + lines[0], *lines[1:]], ests


def what_to_pick(cells: dict[tuple, list[dict]], grid: Grid) -> list[str]:
    """One line per fault mode at its highest rate, from the estimates the skew and validation plots
    draw: the policies without a resolvable skew, the best final validation reward and which
    policies are not resolvably below it (paired by seed), and the pick that follows. A candidate is a
    cell: a policy at one budget and floor (the floor named where the grid has more than one)."""
    lines = []
    for kind in grid.kinds:
        rate = max(r for (k, r, *_) in cells if k == kind)
        here = {(p, b, f): rs for (k, r, p, b, f), rs in cells.items() if k == kind and r == rate}
        alive = {key: rs for key, rs in here.items() if all(r["survived"] for r in rs)}
        name = lambda key: cell_name(grid, *key)  # noqa: E731
        if not alive:
            lines.append(f"- **{kind} {_rate(kind, rate)}**: no policy survived every seed.")
            continue
        shift = {key: _level(rs, "rooms_shift") for key, rs in alive.items()}
        best = max(alive, key=lambda key: _level(alive[key], "val_reward_final").mean)
        gap = {key: _paired(alive[key], alive[best], "val_reward_final") for key in alive if key != best}
        below = [key for key, e in gap.items() if e.sign < 0]
        fair = [key for key in alive if shift[key].sign == 0]
        pick = max(fair, key=lambda key: _level(alive[key], "val_reward_final").mean) if fair else best
        dead = [name(key) for key in here if key not in alive]
        skewed = [f"{name(k)} ({shift[k].text()} rooms)" for k in alive if shift[k].sign]
        lines.append(
            f"- **{kind} {_rate(kind, rate)}**: without a resolvable skew: {', '.join(map(name, fair)) or 'none'}; "
            f"skewed: {', '.join(skewed) or 'none'}. Highest final validation reward: {name(best)}, "
            f"{_ci(alive[best], 'val_reward_final')}; resolvably below it (paired by seed): "
            f"{', '.join(f'{name(k)} ({gap[k].text()})' for k in below) or 'none'}; "
            f"not resolvable from it: {', '.join(name(k) for k in gap if k not in below) or 'none'}. "
            f"Died in some seed: {', '.join(dead) or 'none'}. "
            + (f"Nothing here separates the survivors (no skew and no validation difference is resolvable); "
               f"**{name(pick)}** only has the highest mean." if len(fair) == len(alive) and not below else
               f"Pick **{name(pick)}**: "
               + ("the policy without a resolvable skew that validates best" if pick in fair else
                  "every survivor skews; it validates best")
               + ("." if pick == best or gap[pick].sign == 0 else
                  f", though it validates resolvably below {name(best)} ({gap[pick].text()}).")
               + (" Its validation lead is not resolvable, so the pick rests on the skew." if pick in fair and not below
                  else ""))
            + (" With one seed per cell these are single runs, not evidence."
               if max(map(len, alive.values())) < 2 else ""))
    return lines
