"""One episode's state, shared by the agent's loop (agents/agent.py) and the compaction policies:
the history the model sees, the output the response returns, the evidence (calls, counters, the
guard's decisions) and the token prefix of the last call; also the model client's interface.

Invariant: `history[:initial_len]` is the episode's initial context; `output` only grows; `prefix` is
the last call's prompt + reply tokens while the history since that call has only been appended to,
and None once a compaction rewrote it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Callable, Protocol

from minirl.agents.env import DoorsEnv
from minirl.agents.items import items_to_messages, new_id
from minirl.wire import Coords


@dataclass
class ModelReply:
    """One model call's outcome. `evidence` is None when the call produced no tokens (the server refused
    an over-long prompt)."""

    message: dict
    finish_reason: str
    evidence: dict | None
    error: str | None = None


class ModelClient(Protocol):
    async def chat(
        self, messages: list[dict], tools: list[dict], params: dict, key: str, required_prefix: list[int] | None
    ) -> ModelReply: ...

    async def count_tokens(
        self, messages: list[dict], tools: list[dict], key: str, required_prefix: list[int] | None
    ) -> int:
        """The length of the prompt `chat` with the same messages, tools, key and prefix would send."""
        ...


def prompt_identity(items: list[dict], task: dict, env: DoorsEnv) -> int:
    """The identity of a row's prompt, the same for every rollout and attempt of it (their rows
    differ only in seed and bookkeeping): the doors task's seed when `items` are that task's own
    opening (its prompt is a function of the seed), else a digest of the input items and the task
    (a dataset row: rows may share a task and differ in their input)."""
    if items == env.initial_input():
        return env.seed
    text = json.dumps([items, task], sort_keys=True)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass
class Evidence:
    """What the agent saw and decided, returned beside the output for the controller's ledger
    (`as_dict`: the rollout's `evidence`, the counters flat beside the other fields)."""

    calls: int = 0
    compactions: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    """The compaction policies' counters by name (each policy declares its own `COUNTERS`; the agent
    starts every counter the registry declares at 0, agents/compaction/__init__.py)."""
    guard: list[dict] = field(default_factory=list)
    summary: list[dict] = field(default_factory=list)
    """One flat record per summary request: compaction, request, decision, reason, tokens."""
    capture_failed: bool = False
    end_reason: str = "max_steps"
    errors: list[str] = field(default_factory=list)
    segment_rewards: list[float | None] = field(default_factory=list)
    """Summarizing compaction: per summary in the output (accepted, or failed under `end_episode_scored`),
    its next segment's score (summarize.segment_rewards; `grpo.summary_credit=next_segment` trains the
    summary on it). Sent only when non-empty."""

    def add(self, counters: dict[str, int]) -> None:
        for name, n in counters.items():
            self.counters[name] = self.counters.get(name, 0) + n

    def count(self, name: str) -> int:
        return self.counters.get(name, 0)

    def as_dict(self) -> dict:
        return {"calls": self.calls, "compactions": self.compactions, **self.counters, "guard": self.guard,
                "summary": self.summary, "capture_failed": self.capture_failed, "end_reason": self.end_reason,
                "errors": self.errors, **({"segment_rewards": self.segment_rewards} if self.segment_rewards else {})}


@dataclass
class Episode:
    """One `/run` episode in progress."""

    history: list[dict]
    """Items the next model call sees (compaction rewrites it)."""
    tools: list[dict]
    """Chat-completions tools sent with every call."""
    initial_len: int
    """`history[:initial_len]` is the row's input."""
    prompt: int = 0
    """The prompt's identity (`prompt_identity`): what a per-prompt draw (summarize's threshold) is seeded by."""
    sampling: dict = field(default_factory=dict)
    """The row's sampling parameters (`seed` is advanced per call)."""
    coords: Coords | None = None
    env: DoorsEnv | None = None
    output: list[dict] = field(default_factory=list)
    """Every item the episode produced, in order: the response's output."""
    ev: Evidence = field(default_factory=Evidence)
    prefix: list[int] | None = None
    """Prompt + reply tokens of the last call, while the history is unrewritten."""
    fault: Callable[..., bool] | None = None
    """The attempt's agent-side fault site (`faults.fault_site`), for a policy's injected faults."""
    stopped: bool = False
    """A compaction ended the episode (`ev.end_reason` says why): no further model call."""

    def call_key(self, call: int) -> str:
        """The key of turn call `call`: `<rollout>.c<call>` (the server's rollout header; the model client
        keeps a rollout's calls on one worker by it), or a fresh call id for a row without coordinates."""
        return f"{self.coords.key}.c{call}" if self.coords else new_id("call")

    async def prompt_tokens(self, client: ModelClient, history: list[dict] | None = None) -> int:
        """The length of the prompt the next turn call sends (`ModelClient.count_tokens`, on that call's
        worker): the history with the token prefix spliced in as the call splices it, or (`history`) a
        history a compaction is about to install, which goes without a prefix."""
        prefix = self.prefix if history is None else None
        messages = items_to_messages(self.history if history is None else history)
        return await client.count_tokens(messages, self.tools, self.call_key(self.ev.calls), prefix)
