"""Issues 49 (AA: MEDIUM 6 and three LOWs) and 51 (Y item 2): which agent servers are down, and
when a down one is looked at again.

Real parts only: stand-in agent servers are real aiohttp servers on 127.0.0.1 (one answers `/run`
with a proxy's HTML error page, one never answers `/run`, one answers it); the restart case
(tests/integration/test_agent_servers.py) kills one of minirl's own agent servers with the seeded `agent_kill`
fault and Ray restarts it at its port.
"""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
from aiohttp import web

from helpers import serve_run
from minirl.config import ConfigError, load_config
from minirl.data import prompt_row
from minirl.rollout.agent_pool import AgentPool
from minirl.rollout.manager import RolloutManager
from minirl.wire import RolloutDataFailure

GOOD_ITEM = {"type": "function_call", "name": "open_door", "arguments": "{}", "call_id": "c",
             "prompt_token_ids": [1, 2, 3], "generation_token_ids": [5, 6], "generation_log_probs": [-0.1, -0.2]}
PROXY_PAGE = "<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1></body></html>"


async def good_run(request):
    return web.json_response({**(await request.json()), "response": {"output": [GOOD_ITEM]}, "reward": 1.0})


async def html_run(request):
    await request.read()
    return web.Response(text=PROXY_PAGE, content_type="text/html")  # 200: a proxy's error page


RELEASE: list[asyncio.Event] = []  # set when a test's servers close: the hung handler then returns


async def hung_run(request):
    await request.read()
    await RELEASE[-1].wait()  # never answers while the test runs
    return web.Response(status=503)


def small_cfg(base_cfg, groups=2, **agent):
    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = groups, 2
    cfg.policy.train_global_batch_size = groups * 2
    cfg.async_rl.rollout_failure.max_skipped_prompts = 0
    for key, value in agent.items():
        setattr(cfg.agent, key, value)
    return cfg


def steps(cfg, handlers, n_steps):
    """`n_steps` steps through one RolloutManager over stand-in agent servers (one per handler, in
    order): -> (each step's (outcomes or its error, agent_stats, seconds), events, urls). Backoff
    is recorded, not slept."""
    events, results = [], []

    async def sleep(s):
        pass

    async def go():
        RELEASE.append(asyncio.Event())
        served = [await serve_run(h) for h in handlers]
        urls = [url for _, url in served]
        m = RolloutManager(cfg, urls, events.append, 512, sleep=sleep)
        try:
            for step in range(n_steps):
                rows = [prompt_row(cfg, step, g) for g in range(cfg.grpo.num_prompts_per_step)]
                t0 = time.monotonic()
                try:
                    outcomes = await m.run_step(step, rows)
                except Exception as exc:  # noqa: BLE001 - the test reads it
                    outcomes = exc
                results.append((outcomes, m.agent_stats(), time.monotonic() - t0))
        finally:
            await m.session.close()
            RELEASE[-1].set()
            for runner, _ in served:
                await runner.cleanup()
        return urls

    urls = asyncio.run(go())
    return results, events, urls


def test_a_down_server_is_probed_after_its_wait_and_the_wait_doubles_until_a_run_answers():
    now = [0.0]
    pool = AgentPool(["a", "b"], retry_s=2.0, max_retry_s=5.0, max_failures=2, clock=lambda: now[0])
    down = pool.failed("a", "refused", 0.0)  # refused: down at once
    assert (down.reason, down.retry_at) == ("refused", 2.0) and pool.due() == [] and pool.pick() == "b"
    now[0] = 2.0
    assert pool.due() == ["a"] and pool.due() == [], "one probe at a time"
    assert pool.probed("a", ok=False) is None and pool.downs["a"].retry_at == 6.0, "a failed probe: the wait doubles"
    now[0] = 6.0
    assert pool.due() == ["a"] and pool.probed("a", ok=True).reason == "refused" and pool.down() == []
    assert pool.failed("a", "bad_answer", 6.0).retry_at == 11.0, \
        "back by its probe, not a /run: down at its next failure"
    assert pool.answered("a") is not None and pool.down() == []  # a /run answered: up, its count and wait reset
    assert pool.failed("a", "bad_answer", 6.0) is None, "one bad answer after an answer: not down yet"
    assert pool.failed("a", "bad_answer", 6.0).retry_at == 8.0
    pool.answered("b")  # at 6.0
    assert pool.failed("b", "timeout", sent_at=5.0) is None and pool.failures["b"] == 0, \
        "it answered meanwhile: not silent"
    assert (pool.failed("b", "timeout", sent_at=7.0) is None
            and pool.failed("b", "timeout", sent_at=7.0).reason == "timeout")
    assert pool.pick() == "a", "every server down: the one down longest"


def test_an_agent_server_answering_html_beside_a_healthy_one_is_passed_over_and_named(base_cfg):
    """AA MEDIUM 6: one agent server answers `/run` with 200 and a proxy's HTML page. It used to end
    the run at step 0 (the DATA retry went back to it; the last line named no server). Now each bad
    answer is re-sent at once on the healthy server, the HTML server is marked down after two
    (`agent.max_server_failures`), the next step sends it nothing, and every failure names it."""
    cfg = small_cfg(base_cfg, groups=4, down_retry_s=60.0, down_retry_max_s=60.0)
    results, events, (html, good) = steps(cfg, [html_run, good_run], 2)
    for outcomes, _, _ in results:
        assert not isinstance(outcomes, Exception), outcomes
        assert [o.status for o in outcomes] == ["committed"] * 4 and all(len(o.rollouts) == 2 for o in outcomes)
    failed = [e for e in events if e["type"] == "failure"]
    assert failed and {(e["reason"], e["agent"], e["decision"], e["scope"]) for e in failed} == {
        ("AgentBadAnswer", html, "retried", "row")}
    assert f"from the agent server at {html}" in failed[0]["error"] and "'text/html" in failed[0]["error"]
    assert "the body opens '<html><head><title>502 Bad Gateway" in failed[0]["error"]
    (down,) = [e for e in events if e["type"] == "agent_down"]
    assert (down["agent"], down["reason"], down["retry_in_s"],
            down["agent_servers_up"]) == (html, "bad_answer", 60.0, 1)
    assert results[1][1] == {"agent_servers_up": 1, "agent_sends": {html: 0, good: 8}}, "the next step passes it over"

    # the HTML server alone: the run ends, and its last line names the server
    cfg.async_rl.rollout_failure.max_skipped_prompts = 1
    ((error, stats, _),), events, (html,) = steps(cfg, [html_run], 1)
    assert isinstance(error, RolloutDataFailure) and str(error).startswith("skipped 1 prompts")
    assert "Dominant failure (all 2 lost group(s)): AgentBadAnswer: malformed /run result" in str(error)
    assert f"returned invalid JSON from the agent server at {html}" in str(error)
    assert stats["agent_servers_up"] == 0


def test_a_hung_agent_server_is_named_in_timeouts_and_then_passed_over(base_cfg):
    """AA LOW: a hanging agent server was not avoided (2 steps took 156 s) and timeout events named no
    agent. Each row still in flight at the group deadline now names the server it was on; a server
    that answered nothing meanwhile is charged, twice marks it down, and the next step sends it
    nothing and finishes without a timeout."""
    cfg = small_cfg(base_cfg, down_retry_s=60.0, down_retry_max_s=60.0)
    cfg.async_rl.rollout_failure.nemo_gym.rollout_timeout_s = 2.0
    results, events, (hung, good) = steps(cfg, [hung_run, good_run], 2)
    for outcomes, _, _ in results:
        assert not isinstance(outcomes, Exception), outcomes
        assert [o.status for o in outcomes] == ["committed"] * 2
    timeouts = [e for e in events if e["type"] == "failure"]
    assert timeouts and {(e["step"], e["reason"], e["agent"], e["decision"]) for e in timeouts} == {
        (0, "RolloutTimeout", hung, "retried")}, timeouts
    (down,) = [e for e in events if e["type"] == "agent_down"]
    assert (down["agent"], down["reason"], down["agent_servers_up"]) == (hung, "timeout", 1)
    assert results[1][1] == {"agent_servers_up": 1, "agent_sends": {hung: 0, good: 4}}
    assert results[0][2] >= 2.0 and results[1][2] < 2.0, "one deadline (2 s) in step 0, none in step 1"


def test_a_misdirected_agent_url_is_named_in_its_404(base_cfg):
    """AA LOW: a 404 from an agent URL that points elsewhere (here the server's `/v1`) named no URL."""
    cfg = small_cfg(base_cfg, groups=1)

    async def go():
        runner, url = await serve_run(good_run)
        m = RolloutManager(cfg, [url + "/v1"], [].append, 512)
        try:
            with pytest.raises(RolloutDataFailure) as err:
                await m.run_step(0, [prompt_row(cfg, 0, 0)])
            return url, str(err.value)
        finally:
            await m.session.close()
            await runner.cleanup()

    url, message = asyncio.run(go())
    assert message.startswith("NeMo-Gym /run failed with HTTP 404: ") and message.endswith(f"(POST {url}/v1/run)")


@pytest.mark.parametrize("urls", [["http://127.0.0.1:8000", "http://127.0.0.1:8000/"],
                                  ["http://localhost:8000", "http://127.0.0.1:8000"],
                                  ["http://LOCALHOST:80/agents/", "http://127.0.0.1/agents"]])
def test_one_agent_server_written_two_ways_is_refused(urls):
    """AA LOW: the duplicate-URL check missed a trailing slash and localhost against 127.0.0.1."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"agent.external_url=[{', '.join(urls)}]"])
    assert str(err.value) == f"agent.external_url: lists one agent server twice: {urls[0]!r} and {urls[1]!r}"
    load_config(None, ["agent.external_url=[http://127.0.0.1:8000, http://127.0.0.1:8001, http://127.0.0.1:8000/b]"])
