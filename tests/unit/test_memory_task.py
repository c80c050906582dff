"""`env.task=doors_memory`: a task where memory matters (issue 30 item 1).

The last room hides its door; its code was shown once, as a note in the second room's picture (a
tool reply). A scripted reader that answers from what its prompt shows, driven through the real
agent loop (`run_episode`, real compaction), is near chance on the last room under recency
compaction and at the ceiling with an oracle summary that keeps the note. No Ray, no vLLM.
"""

from __future__ import annotations

import json
import math
import random
import re

import pytest

from minirl.agents.agent import ModelReply
from minirl.agents.compaction import POLICIES, RewritePolicy
from minirl.agents.env import NOTE_ROOM, DoorsEnv, make_rooms, verify
from minirl.agents.items import items_to_messages
from minirl.agents.server import BadRow, parse_row
from minirl.config import ConfigError, MinirlConfig, load_config
from minirl.data import prompt_row
from helpers import play_episodes

ROOMS = 5  # keep_last_groups K drops the note's picture before the last call when ROOMS >= K + 2
SEEDS = 200
PICTURE = re.compile(r"<image>(.*?)</image>", re.S)


def prompt_text(messages: list[dict]) -> str:
    return "\n".join(m.get("content") or "" for m in messages)


class Reader:
    """A scripted model: reads the door of the newest picture; for `door?` it uses a `note<d>` seen
    anywhere in its prompt, else guesses among the digits the picture does not show (the distractors
    never carry the door's code, so this is the best a reader without memory can do)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.last_room_guessed: list[bool] = []

    async def chat(self, messages, tools, params, key, required_prefix):
        text = prompt_text(messages)
        labels = PICTURE.findall(text)[-1].split("\n")[1:]
        door = next(label[4:] for label in labels if label.startswith("door"))
        if door != "?":
            code = int(door)
        else:
            notes = re.findall(r"note(\d)", text)
            self.last_room_guessed.append(not notes)
            shown = {int(label[-1]) for label in labels if label[-1].isdigit()}
            code = int(notes[-1]) if notes else self.rng.choice([d for d in range(10) if d not in shown])
        call = {"id": f"call_{key}", "type": "function",
                "function": {"name": "open_door", "arguments": json.dumps({"code": code})}}
        evidence = {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [0.0]}
        return ModelReply({"role": "assistant", "content": "", "tool_calls": [call]}, "tool_calls", evidence)

    async def count_tokens(self, messages, tools, key, required_prefix):
        return len(prompt_text(messages))


SUMMARY_ID = "oracle_summary"


class OracleSummary:
    """Test-only policy: recency, plus a summary message (after the initial context) that keeps every
    `memory_facts()` text the history showed and the rewrite dropped; an oracle summarizer."""

    COUNTERS = RewritePolicy.COUNTERS

    def __init__(self, cfg) -> None:
        self.recency = RewritePolicy(cfg)

    async def compact(self, episode, client):
        seen = prompt_text(items_to_messages(episode.history))
        facts = [f["text"] for f in episode.env.memory_facts() if f["text"] in seen]
        result = await self.recency.compact(episode, client)
        items = [it for it in result.items if it.get("id") != SUMMARY_ID]
        lost = [f for f in facts if f not in prompt_text(items_to_messages(items))]
        if lost:
            summary = {"type": "message", "id": SUMMARY_ID, "role": "user",
                       "content": "Summary of earlier context: " + " ".join(lost)}
            items.insert(episode.initial_len, summary)
        result.items, result.changed = items, items != episode.history
        return result


@pytest.fixture
def oracle_policy():
    POLICIES["oracle_summary"] = OracleSummary
    yield "oracle_summary"
    POLICIES.pop("oracle_summary")


def memory_cfg(policy: str = "recency", keep_last_groups: int | None = None, rooms: int = ROOMS) -> MinirlConfig:
    """configs/default.yaml (recency, keep_last_groups=1) on the memory task; one try per room, so
    the last call is the last room's only try. `policy` is set after loading (a test-only name)."""
    overrides = ["env.task=doors_memory", f"env.num_rooms={rooms}", f"agent.max_steps={rooms}"]
    if keep_last_groups is not None:
        overrides.append(f"agent.context_history.policy.config.images.keep_last_groups={keep_last_groups}")
    cfg = load_config(overrides=overrides)
    cfg.agent.context_history.policy.type = policy
    return cfg


def last_room_rate(cfg: MinirlConfig, seeds: int = SEEDS) -> tuple[int, list[dict], Reader]:
    """Successes on the last room (its first and only try) over `seeds` prompts, through run_episode."""
    reader = Reader(0)
    results = play_episodes(cfg, reader, seeds)
    wins = 0
    for res in results:
        calls = [it for it in res["response"]["output"] if it["type"] == "function_call"]
        rooms = res["task"]["num_rooms"]
        assert len(calls) == rooms  # every earlier room opened on its first try
        win = json.loads(calls[-1]["arguments"])["code"] == make_rooms(res["task"]["seed"], rooms)[-1].code
        assert res["reward"] == (rooms - 1 + win) / rooms
        wins += win
    return wins, results, reader


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (mid - half) / (1 + z * z / n), (mid + half) / (1 + z * z / n)


@pytest.mark.parametrize("keep", [None, 3])  # default.yaml's 1, and the dataclass default 3
def test_recency_compaction_is_near_chance_on_the_last_room(keep):
    wins, results, reader = last_room_rate(memory_cfg("recency", keep))
    lo, hi = wilson(wins, SEEDS)
    print(f"recency keep_last_groups={keep or 1}: last room {wins}/{SEEDS} = {wins / SEEDS:.3f}, 95% CI [{lo:.3f}, "
          f"{hi:.3f}]")
    assert all(reader.last_room_guessed), "recency must have dropped the note before the last call"
    assert all(r["evidence"]["images_dropped"] > 0 for r in results)
    assert hi < 0.3  # chance is 1/7..1/10 (digits the last picture does not show)


def test_oracle_summary_is_at_the_ceiling_on_the_last_room(oracle_policy):
    wins, results, reader = last_room_rate(memory_cfg(oracle_policy))
    lo, hi = wilson(wins, SEEDS)
    print(f"oracle summary: last room {wins}/{SEEDS} = {wins / SEEDS:.3f}, 95% CI [{lo:.3f}, {hi:.3f}]")
    assert not any(reader.last_room_guessed)
    assert all(r["evidence"]["images_dropped"] > 0 for r in results)  # the pictures were still dropped
    assert lo > 0.95


@pytest.mark.parametrize("policy, keep, rooms", [("identity", None, ROOMS), ("recency", 3, 4)])
def test_the_note_survives_without_compaction_or_with_enough_kept_pictures(policy, keep, rooms):
    wins, _, reader = last_room_rate(memory_cfg(policy, keep, rooms), seeds=50)
    assert wins == 50 and not any(reader.last_room_guessed)


def test_note_is_in_a_tool_reply_so_protect_initial_context_does_not_keep_it():
    env = DoorsEnv(17, ROOMS, "doors_memory")
    fact = env.memory_facts()
    assert fact == [{"text": f"note{env.rooms[-1].code}", "shown_in_room": NOTE_ROOM, "needed_in_room": ROOMS - 1}]
    initial = prompt_text(items_to_messages(env.initial_input()))
    assert "note" not in initial and f"door{env.rooms[0].code}" in initial
    env.step("open_door", json.dumps({"code": env.rooms[0].code}))
    reply = env.step("open_door", json.dumps({"code": 99}))  # wrong code: the same room, note again
    assert fact[0]["text"] in reply[1]["image_url"]
    env.room = ROOMS - 1
    last = env._room_parts("x")[1]["image_url"]
    assert last.endswith("\ndoor?") and "note" not in last


def test_same_rooms_and_reward_as_doors_and_default_is_unchanged():
    for seed in range(30):
        plain, mem = DoorsEnv(seed, ROOMS), DoorsEnv(seed, ROOMS, "doors_memory")
        assert plain.rooms == mem.rooms and plain.memory_facts() == []
        assert [plain.picture(r) for r in range(ROOMS)] == [room.picture() for room in make_rooms(seed, ROOMS)]
    default = MinirlConfig()
    assert default.env.task == "doors" and prompt_row(default, 0, 0)["task"]["env"] == "doors"
    assert "note" not in json.dumps(prompt_row(default, 0, 0)) and "door?" not in json.dumps(prompt_row(default, 0, 0))
    row = prompt_row(memory_cfg(), 0, 0)
    codes = [r.code for r in make_rooms(row["task"]["seed"], ROOMS)]
    output = [{"type": "function_call", "name": "open_door", "arguments": json.dumps({"code": c})} for c in codes]
    assert row["task"]["env"] == "doors_memory" and verify(row["task"], output) == 1.0


@pytest.mark.parametrize("overrides, message", [
    (["env.task=doors_memory"], "env.num_rooms: must be >= 3 for env.task=doors_memory, got 2"),
    (["env.task=doors_memory", "env.num_rooms_choices=[3,2]"], "env.num_rooms_choices[1]: must be >= 3"),
    (["env.task=memory"], "env.task"),
])
def test_bad_task_configs_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)
    assert load_config(overrides=["env.task=doors_memory", "env.num_rooms=3"]).env.task == "doors_memory"


def test_agent_server_refuses_an_unknown_or_too_short_memory_task():
    cfg = memory_cfg()
    row = prompt_row(cfg, 0, 0)
    assert parse_row(json.dumps(row).encode(), cfg)[0]["task"]["env"] == "doors_memory"
    for task in ({**row["task"], "env": "maze"}, {**row["task"], "num_rooms": 2}):
        with pytest.raises(BadRow, match="task.env must be one of"):
            parse_row(json.dumps({**row, "task": task}).encode(), cfg)
