"""The rollout pump's failures reach the train pump as themselves, and what it reports names the right
step: an exception in its dispatch loop ends the take at once (never a silent wait), a training row
that would raise there (a `difficulty` no prompt class can be) is refused before the run with its
file and line, and the manager's `stall` events name the step the run is on. The real source, pump and
rollout manager, its `/run` injected as tests/integration/test_failure_policy.py injects it: nothing
is started."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from minirl.async_rl.source import BufferSource
from minirl.config import ConfigError, load_config
from minirl.data import check_rows, task_row, task_seed
from minirl.rollout.manager import RolloutManager
from minirl.wire import GymTransportError, RolloutStall

ITEM = {"type": "function_call", "name": "open_door", "arguments": "{}", "call_id": "c",
        "prompt_token_ids": [1, 2, 3], "generation_token_ids": [5, 6], "generation_log_probs": [-0.1, -0.2]}


async def no_records(step: int) -> list[dict]:
    return []


def rows_file(path, extra=None) -> str:
    """Eight doors rows (distinct seeds), each with `extra` merged in."""
    base = load_config()
    rows = [{**task_row(base, task_seed(base, 1000 + i, 0)), **(extra or {})} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


PACED = ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true", "async_rl.sampler.admission=paced"]


def test_an_exception_in_the_dispatch_loop_reaches_the_train_pump(tmp_path):
    """Paced admission reads the next batch's rows in the dispatch loop itself (`_paced`), outside any
    place, so a failure there (here the dataset file gone mid-run) is the loop's own. Before, nothing
    watched the loop's task: the take waited for groups that would never be dispatched, until a
    RolloutStall that blamed the sampler (or for ever, with stall_timeout_s=null)."""
    path = rows_file(tmp_path / "train.jsonl")
    cfg = load_config(None, [f"data.train_jsonl={path}", *PACED])
    (tmp_path / "train.jsonl").unlink()
    events = []

    async def go():
        manager = RolloutManager(cfg, ["http://127.0.0.1:9"], events.append, 100)
        source = BufferSource(cfg, manager, no_records)
        try:
            with pytest.raises(ConfigError, match=r"^data.train_jsonl: cannot read .*train.jsonl"):
                await asyncio.wait_for(source.take(0, 0), 5)
        finally:
            await source.close()
            await manager.session.close()

    asyncio.run(go())
    assert not [e for e in events if e["type"] in ("dispatch", "stall")]


def test_a_training_rows_difficulty_that_no_prompt_class_can_be_is_refused_with_its_line(tmp_path):
    """Paced admission keys what it observed by each row's stated `difficulty`: an object or an array
    cannot be a key, and raised TypeError in the dispatch loop. It is a bad row under paced admission
    (the file and the line named, as every bad row is), and a scalar, or any value unpaced, is not."""
    hard = rows_file(tmp_path / "hard.jsonl", {"difficulty": {"tier": "hard", "rooms": 3}})
    cfg = load_config(None, [f"data.train_jsonl={hard}", *PACED])
    with pytest.raises(ConfigError, match=r"^data.train_jsonl: '.*hard.jsonl' line 1: difficulty must be a string, "
                                          r"a number, a boolean or null .* got \{\"tier\": \"hard\", \"rooms\": 3\} "
                                          r"\(an object\)$"):
        check_rows(cfg, "train_jsonl")
    assert check_rows(load_config(None, [f"data.train_jsonl={hard}"]), "train_jsonl") is None  # eager: unread
    tiers = rows_file(tmp_path / "tiers.jsonl", {"difficulty": "hard"})
    assert check_rows(load_config(None, [f"data.train_jsonl={tiers}", *PACED]), "train_jsonl") is None


def run_one_group_steps(stall_timeout_s: float, post, steps: int, events: list, taken: list,
                        train_s: float = 0.0) -> None:
    """An async run at staleness 0, one group of 2 rollouts a step, its `/run` answered by `post`: takes
    `steps` steps (each "training" `train_s` before its weight sync), appending each take's (step, status)
    pairs to `taken` and the manager's events to `events`; whatever the run raises propagates."""
    cfg = load_config(None, ["async_rl.enabled=true", "grpo.num_prompts_per_step=1",
                             "grpo.num_generations_per_prompt=2", "policy.train_global_batch_size=2",
                             "async_rl.sampler.max_staleness_versions=0",
                             f"async_rl.stall_watchdog.stall_timeout_s={stall_timeout_s}"])

    async def go():
        manager = RolloutManager(cfg, ["http://127.0.0.1:9"], events.append, 100, post=post)
        source = BufferSource(cfg, manager, no_records)
        try:
            for step in range(steps):
                take = await asyncio.wait_for(source.take(step, step), 10)
                taken.append([(o.step, o.status) for o in take.outcomes])
                if train_s:
                    await asyncio.sleep(train_s)
                source.syncing()
                source.published(step + 1)
        finally:
            await source.close()
            await manager.session.close()

    asyncio.run(go())


def test_a_stall_event_names_the_step_the_train_pump_is_on():
    """One manager watchdog runs for the whole async run: its `stall` event named the step the pump
    started at (0) for ever. Here step 2's group hangs (an agent server that took the request and never
    answers) while the train pump waits for step 2."""
    events, taken = [], []

    async def post(session, url, row):
        if row["_minirl"]["step"] == 2:
            await asyncio.Event().wait()
        return {**row, "response": {"output": [ITEM]}, "reward": 0.0}

    with pytest.raises(RolloutStall, match=r"no rollout completed .* 2 in flight: s2.g0.r"):
        run_one_group_steps(0.4, post, 3, events, taken)
    assert taken == [[(0, "committed")], [(1, "committed")]]
    assert [(e["step"], e["in_flight"]) for e in events if e["type"] == "stall"] == [(2, 2)]


def test_an_idle_pump_between_steps_is_no_stall():
    """Staleness 0: the pump sends nothing while a step trains. The watchdog timed idleness from the last
    completed send, so the first send after a training step longer than stall_timeout_s was a stall at
    once, though nothing had been in flight meanwhile (found by review). Each rollout takes 0.2 s here, each
    step trains 1 s against a 0.5 s timeout: no stall; a rollout that hangs is still one."""
    events, taken = [], []

    async def post(session, url, row):
        await (asyncio.Event().wait() if row["_minirl"]["step"] == 3 else asyncio.sleep(0.2))
        return {**row, "response": {"output": [ITEM]}, "reward": 0.0}

    with pytest.raises(RolloutStall, match=r"no rollout completed for 0\.[5-9].* 2 in flight: s3.g0.r"):
        run_one_group_steps(0.5, post, 4, events, taken, train_s=1.0)  # train_s: nothing dispatched at staleness 0
    assert taken == [[(s, "committed")] for s in range(3)]
    assert [(e["step"], e["in_flight"]) for e in events if e["type"] == "stall"] == [(3, 2)]


def test_a_group_retry_waits_out_a_weight_sync_and_starts_under_the_new_version():
    """Dispatch pauses during a weight sync (upstream), and a group retry is a dispatch too. Step 1's
    group, dispatched a version ahead, fails its first attempt (INFRA); the sync begins while it backs
    off, and its retry goes out only once the new weights are served, stamped with them. Before, the
    retry went out in the middle of the sync, stamped with the old version."""
    cfg = load_config(None, ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                             "grpo.num_prompts_per_step=1", "grpo.num_generations_per_prompt=2",
                             "policy.train_global_batch_size=2", "async_rl.rollout_failure.backoff_base_s=1.0",
                             "async_rl.rollout_failure.nemo_gym.max_row_attempts=1",
                             "async_rl.rollout_failure.nemo_gym.keep_returned_rows=false"])
    events, sends, clock, held = [], [], {}, {}

    async def post(session, url, row):
        c = row["_minirl"]
        sends.append((c["step"], c["rollout"], time.monotonic()))
        if (c["step"], c["rollout"]) == (1, 0) and "sync" not in clock:
            held["source"].syncing()  # a weight sync begins as the attempt fails, so the retry's backoff ends in it
            clock["sync"] = time.monotonic()
            raise GymTransportError("NeMo-Gym /run for step 1 failed in transport: reset")
        return {**row, "response": {"output": [ITEM]}, "reward": 0.0}

    async def go():
        manager = RolloutManager(cfg, ["http://127.0.0.1:9"], events.append, 100, post=post)
        source = held["source"] = BufferSource(cfg, manager, no_records)
        try:
            await asyncio.wait_for(source.take(0, 0), 10)
            while "sync" not in clock:
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.5)  # past the 1 s backoff
            clock["published"] = time.monotonic()
            source.published(1)
            return await asyncio.wait_for(source.take(1, 1), 10)
        finally:
            await source.close()
            await manager.session.close()

    take = asyncio.run(go())
    retry = [t for step, _, t in sends if step == 1][2:]  # after the failed attempt's two sends
    assert [e["decision"] for e in events if e["type"] == "failure"] == ["retried"]
    assert len(retry) == 2 and min(retry) >= clock["published"], (clock, sends)
    assert [o.status for o in take.outcomes] == ["committed"] and take.start_weights == [1]


def test_a_checkpoint_while_a_lost_group_moves_its_records_charges_its_drop_once():
    """Group 0 is dropped (its drop charged) and is moving its call records off the servers when the
    checkpoint is cut. The pump listed it in flight, so the resumed run sent the prompt again and charged
    its drop a second time (here past a budget of 1: the run ended); now it is its lost record, and the
    resumed step takes what the uninterrupted one took, with no second drop (found by review)."""
    cfg = load_config(None, ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                             "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                             "policy.train_global_batch_size=4", "grpo.max_num_steps=1",
                             "async_rl.rollout_failure.max_infra_attempts_per_prompt=1",
                             "async_rl.rollout_failure.max_consecutive_dropped_prompts=1",
                             "async_rl.rollout_failure.min_step_batch_fraction=0.5",
                             "async_rl.stall_watchdog.stall_timeout_s=null"])

    async def post(session, url, row):
        if row["_minirl"]["group"] == 0:
            await asyncio.sleep(0.05)  # group 1 commits first
            raise GymTransportError("NeMo-Gym /run failed with HTTP 503: down")
        return {**row, "response": {"output": [ITEM]}, "reward": 0.0}

    async def nosleep(s):
        pass

    async def run(resume=None, cut=False):
        events, moved, moves = [], asyncio.Event(), []

        async def drain(step):
            moves.append(step)
            if cut and len(moves) == 2:  # the dropped group's move: the checkpoint is cut while it waits
                await moved.wait()
            return []

        manager = RolloutManager(cfg, ["http://127.0.0.1:9"], events.append, 100, sleep=nosleep, post=post)
        source = BufferSource(cfg, manager, drain)
        if resume is not None:
            source.restore(resume[0])
            manager.load_state(resume[1])
        checkpoint = None
        try:
            taking = asyncio.ensure_future(source.take(0, 0))
            if cut:
                while len(moves) < 2:
                    await asyncio.sleep(0.01)
                checkpoint = source.snapshot(), manager.state()  # Controller.snapshot: between two awaits
                moved.set()
            take = await asyncio.wait_for(taking, 5)
        finally:
            await source.close()
            await manager.session.close()
        drops = [(e["step"], e["group"], e["consecutive_drops"]) for e in events if e["type"] == "drop"]
        return sorted((o.step, o.group, o.status) for o in take.outcomes), drops, checkpoint

    taken, drops, checkpoint = asyncio.run(run(cut=True))
    assert taken == [(0, 0, "dropped"), (0, 1, "committed")] and drops == [(0, 0, 1)]
    assert checkpoint[1]["consecutive_drops"] == 1
    resumed, drops, _ = asyncio.run(run(resume=checkpoint))
    assert resumed == taken and drops == []
