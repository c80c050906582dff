"""Context compaction: the policies that rewrite or summarize an agent's history before model calls,
selected by `agent.context_history.policy.type`, and the registry `POLICIES` that names them.
rewrite.py holds `identity` and `recency`, summarize.py `summarize`, base.py what they all implement.
A new policy is a class in a module here, one entry in `POLICIES`, and its name in the `Literal` of
`CompactionPolicyConfig.type` (minirl/config.py).

Invariant: `POLICIES` is built from explicit imports (importing a policy module registers nothing),
and its names are exactly those `CompactionPolicyConfig.type` accepts; `counter_names()` is every
counter a registered policy declares, each once, so every episode's evidence carries the same
counter keys whatever its policy.
"""

from __future__ import annotations

from minirl.agents.compaction.base import CompactionPolicy, CompactionResult, compact_episode, scheduled
from minirl.agents.compaction.rewrite import IdentityPolicy, Rewrite, RewritePolicy, compact
from minirl.agents.compaction.summarize import SummarizePolicy
from minirl.config import ContextHistoryConfig

__all__ = ["POLICIES", "CompactionPolicy", "CompactionResult", "IdentityPolicy", "Rewrite", "RewritePolicy",
           "SummarizePolicy", "compact", "compact_episode", "counter_names", "policy_for", "scheduled"]

POLICIES: dict[str, type[CompactionPolicy]] = {
    "identity": IdentityPolicy,
    "recency": RewritePolicy,
    "summarize": SummarizePolicy,
}
"""`agent.context_history.policy.type` -> the policy class."""


def policy_for(cfg: ContextHistoryConfig) -> CompactionPolicy:
    """The policy `cfg.policy.type` names, built on `cfg`."""
    return POLICIES[cfg.policy.type](cfg)


def counter_names() -> tuple[str, ...]:
    """Every counter the registered policies declare, in registry order, each once."""
    return tuple(dict.fromkeys(name for cls in POLICIES.values() for name in cls.COUNTERS))
