"""Compaction on hand-built histories: what each schedule drops, keeps and marks."""


import pytest

from minirl.agents.compaction import compact, scheduled
from minirl.agents.env import image_part
from minirl.config import ContextHistoryConfig

MARK = "[Earlier image omitted]"


def history():
    """system, user(img0) | r0, call0, out(img1) | r1, call1, out(img2) | r2, call2, out(img3)"""
    items = [
        {"type": "message", "role": "system", "content": "sys"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Room 1."}, image_part("img0")]},
    ]
    for k in range(3):
        items += [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": f"think{k}"}]},
            {"type": "function_call", "call_id": f"c{k}", "name": "open_door", "arguments": '{"code": 1}'},
            {"type": "function_call_output", "call_id": f"c{k}",
             "output": [{"type": "input_text", "text": "Wrong code."}, image_part(f"img{k + 1}")]},
        ]
    return items


def pictures(items):
    out = []
    for it in items:
        content = it.get("output") if it.get("type") == "function_call_output" else it.get("content")
        if isinstance(content, list):
            out += [p["image_url"].split(",", 1)[1] if p["type"] == "input_image" else p["text"]
                    for p in content if p["type"] == "input_image" or p.get("text") == MARK]
    return out


def thoughts(items):
    return [it["summary"][0]["text"] for it in items if it["type"] == "reasoning"]


def cfg(keep_groups=1, keep_blocks=1, protect=True, keep_first=False, schedule="rolling_recency", chunk=1):
    c = ContextHistoryConfig()
    c.policy.config.images.keep_last_groups = keep_groups
    c.policy.config.images.protect_initial_context = protect
    c.policy.config.reasoning.keep_last_blocks = keep_blocks
    c.policy.config.reasoning.keep_first_block = keep_first
    c.schedule.type, c.schedule.actions_per_chunk = schedule, chunk
    return c


def test_recency_keeps_last_groups_and_protects_initial_context():
    h = history()
    res = compact(h, cfg(keep_groups=1), initial_len=2)
    assert pictures(res.items) == ["img0", MARK, MARK, "img3"]
    assert res.images_dropped == 2
    assert thoughts(res.items) == ["think2"]
    assert res.reasoning_dropped == 2
    assert h == history(), "compaction must not mutate its input"


def test_unprotected_initial_context_is_dropped_too():
    res = compact(history(), cfg(keep_groups=2, protect=False), initial_len=2)
    assert pictures(res.items) == [MARK, MARK, "img2", "img3"]


def test_keep_first_block_and_zero_last_blocks():
    assert thoughts(compact(history(), cfg(keep_blocks=1, keep_first=True), 2).items) == ["think0", "think2"]
    assert thoughts(compact(history(), cfg(keep_blocks=0), 2).items) == []


@pytest.mark.parametrize("keep_blocks", range(0, 8))
def test_recency_keeps_the_last_blocks_even_when_there_are_fewer(keep_blocks):
    """3 blocks: keep_last_blocks=k keeps the last min(k, 3), so 3 to 5 drop nothing (before, 4 kept
    only 1 and 5 only 2: the slice's start went negative and counted from the end)."""
    res = compact(history(), cfg(keep_groups=4, keep_blocks=keep_blocks), 2)
    assert thoughts(res.items) == ["think0", "think1", "think2"][3 - min(keep_blocks, 3):]
    assert res.reasoning_dropped == 3 - min(keep_blocks, 3)


def test_nothing_to_drop_is_no_change_and_compaction_is_idempotent():
    res = compact(history(), cfg(keep_groups=3, keep_blocks=3), 2)
    assert not res.changed and res.items == history()
    once = compact(history(), cfg(), 2)
    twice = compact(once.items, cfg(), 2)
    assert not twice.changed and twice.items == once.items


def test_identity_policy_never_rewrites():
    import asyncio

    from minirl.agents.compaction import policy_for
    from minirl.agents.episode import Episode

    c = cfg()
    c.policy.type = "identity"
    ep = Episode(history=history(), tools=[], initial_len=2)
    assert asyncio.run(policy_for(c).compact(ep, None)).items == history()


def test_only_dropped_parts_change():
    h = history()
    res = compact(h, cfg(keep_groups=1, keep_blocks=3), 2)
    kept = [it for it in res.items]
    assert [it["type"] for it in kept] == [it["type"] for it in h]  # no item removed or reordered
    texts = [p.get("text") for it in kept
             for p in (it.get("output") if isinstance(it.get("output"), list) else []) if p["type"] == "input_text"]
    assert texts.count("Wrong code.") == 3


@pytest.mark.parametrize(
    "schedule,chunk,expect",
    [("rolling_recency", 1, [True, True, True, True, True]),
     ("turn_chunked_recency", 2, [False, False, True, False, True]),
     ("turn_chunked_recency", 3, [False, False, False, True, False])],
)
def test_schedules(schedule, chunk, expect):
    c = cfg(schedule=schedule, chunk=chunk)
    assert [scheduled(c, done) for done in range(5)] == expect
    c.enabled = False
    assert not any(scheduled(c, done) for done in range(5))


def test_policies_registered_by_name_apply_through_the_episode():
    """`policy_for` picks the class registered under `policy.type`; `compact_episode` installs a changed
    history, counts the compaction and the policy's own counters, and drops the token prefix; an
    unchanged result leaves the episode as it was."""
    import asyncio

    from minirl.agents.compaction import POLICIES, compact_episode, policy_for
    from minirl.agents.episode import Episode

    assert {"identity", "recency"} <= set(POLICIES)
    c = cfg(keep_groups=1)
    ep = Episode(history=history(), tools=[], initial_len=2, prefix=[1, 2, 3])
    result = asyncio.run(compact_episode(policy_for(c), ep, None))
    expect = compact(history(), c, 2)
    assert result.changed and result.outcome == "completed" and result.model_calls == 0
    assert ep.history == expect.items and ep.prefix is None
    assert (ep.ev.compactions, ep.ev.count("images_dropped"), ep.ev.count("reasoning_dropped")) == (1, 2, 2)
    again = asyncio.run(compact_episode(policy_for(c), ep, None))  # idempotent: nothing left to drop
    assert not again.changed and ep.ev.compactions == 1 and ep.history == expect.items

    c.policy.type = "identity"
    ep = Episode(history=history(), tools=[], initial_len=2, prefix=[1, 2, 3])
    assert not asyncio.run(compact_episode(policy_for(c), ep, None)).changed
    assert ep.history == history() and ep.prefix == [1, 2, 3] and ep.ev.compactions == 0
