"""The compaction package's registry: built from explicit imports, its names exactly the config's,
each policy's counters declared by the policy, and every episode's evidence of one shape."""

import asyncio
import typing

import pytest

from minirl.agents.agent import ModelReply, run_episode
from minirl.agents.compaction import POLICIES, CompactionResult, compact, compact_episode, counter_names, policy_for
from minirl.agents.episode import Episode
from minirl.config import CompactionPolicyConfig, ContextHistoryConfig, load_config
from minirl.data import prompt_row

EVIDENCE_KEYS = {"calls", "compactions", "images_dropped", "reasoning_dropped", "guard", "summaries",
                 "summary_attempts_rejected", "summaries_failed", "summary_tokens", "summary_tokens_before",
                 "summary_tokens_after", "summary_facts_needed", "summary_facts_recalled", "summary",
                 "capture_failed", "end_reason", "errors"}
"""The evidence's keys before the counters moved to their policies (the wire shape must not change)."""


def test_registry_names_are_the_configs_policy_types():
    names = typing.get_args(typing.get_type_hints(CompactionPolicyConfig)["type"])
    assert set(POLICIES) == set(names) == {"identity", "recency", "summarize"}
    for name in names:
        cfg = ContextHistoryConfig()
        cfg.policy.type = name
        assert type(policy_for(cfg)) is POLICIES[name]


def test_each_policy_declares_its_counters():
    assert POLICIES["identity"].COUNTERS == ()
    assert POLICIES["recency"].COUNTERS == ("images_dropped", "reasoning_dropped")
    assert set(POLICIES["recency"].COUNTERS) < set(POLICIES["summarize"].COUNTERS)  # its recency_fallback
    assert set(counter_names()) == EVIDENCE_KEYS - {"calls", "compactions", "guard", "summary", "capture_failed",
                                                    "end_reason", "errors"}


class Undeclared:
    COUNTERS = ("declared",)

    def __init__(self, cfg) -> None:
        pass

    async def compact(self, episode, client):
        return CompactionResult(list(episode.history), counters={"declared": 1, "sneaked_in": 2})


def test_a_counter_the_policy_did_not_declare_is_an_error():
    ep = Episode(history=[], tools=[], initial_len=0)
    with pytest.raises(ValueError, match=r"Undeclared returned counters \['sneaked_in'\] not in its COUNTERS"):
        asyncio.run(compact_episode(Undeclared(None), ep, None))
    assert ep.ev.counters == {}


def test_identity_compact_keeps_everything_and_compact_has_no_type_branch():
    """`identity` is its own policy; `compact` rewrites by `policy.config` whatever the type says."""
    items = [{"type": "message", "role": "system", "content": "sys"}] + [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": f"t{k}"}]} for k in range(5)]
    cfg = ContextHistoryConfig()
    cfg.policy.type = "identity"
    ep = Episode(history=list(items), tools=[], initial_len=1, prefix=[1])
    result = asyncio.run(compact_episode(policy_for(cfg), ep, None))
    assert not result.changed and result.counters == {} and ep.history == items and ep.prefix == [1]
    assert compact(items, cfg, 1).reasoning_dropped == 2  # keep_last_blocks=3 of 5


class Quiet:
    """A model that answers once with no tool call: the episode ends after one call."""

    async def chat(self, messages, tools, params, key, required_prefix):
        evidence = {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [0.0]}
        return ModelReply({"role": "assistant", "content": "done"}, "stop", evidence)

    async def count_tokens(self, messages, tools, key, required_prefix):
        return 1


@pytest.mark.parametrize("agent,policy", [("simple_agent", "recency"), ("compaction_agent", "identity"),
                                          ("compaction_agent", "recency"), ("compaction_agent", "summarize")])
def test_every_episodes_evidence_has_the_same_keys(agent, policy):
    cfg = load_config(overrides=[f"agent.name={agent}", f"agent.context_history.policy.type={policy}"])
    row = {**prompt_row(cfg, 0, 0), "_rowidx": 0, "_minirl": {"step": 0, "group": 0, "rollout": 0, "attempt": 0}}
    ev = asyncio.run(run_episode(row, cfg.agent, Quiet()))["evidence"]
    assert set(ev) == EVIDENCE_KEYS and ev["calls"] == 1 and ev["end_reason"] == "no_tool_call"
    assert all(ev[name] == 0 for name in counter_names())
