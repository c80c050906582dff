"""The work between two turns of a rollout (P4's between-turn gaps): the agent's compaction shares what it
does not rewrite, an answered episode sends its next call without yielding first, and the front end checks
a token prefix against the vocabulary as vLLM does, without asking the engine's process."""

import asyncio
import json
import types

import pytest

from minirl.agents.agent import ModelReply, run_episode
from minirl.agents.compaction import compact
from minirl.agents.env import image_part
from minirl.config import ContextHistoryConfig, load_config
from minirl.data import prompt_row
from minirl.wire import Coords


def _history() -> list[dict]:
    """An initial context, then three calls, each with its token evidence, a reasoning item and a picture."""
    items = [{"type": "message", "role": "user", "content": "Open the doors."}]
    for k in range(3):
        items += [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": f"think{k}"}]},
            {"type": "function_call", "call_id": f"c{k}", "name": "open_door", "arguments": '{"code": 1}',
             "prompt_token_ids": list(range(100 * k, 100 * k + 50)), "generation_token_ids": [7, 8, 2],
             "generation_log_probs": [-0.5, -0.25, -0.125]},
            {"type": "function_call_output", "call_id": f"c{k}",
             "output": [{"type": "input_text", "text": "Wrong code."}, image_part(f"img{k}")]},
        ]
    return items


def test_compaction_shares_the_items_it_keeps_and_copies_the_ones_it_rewrites():
    """`compact` used to deep-copy the whole history (every call's token ids and logprobs) before each model
    call; now an item it keeps is the input's own, an item it rewrites is a new dict, and the input is unchanged."""
    cfg = ContextHistoryConfig()
    cfg.policy.config.images.keep_last_groups = 1
    cfg.policy.config.reasoning.keep_last_blocks = 1
    items = _history()
    before = _history()
    out = compact(items, cfg, initial_len=1)
    assert items == before, "compaction must not mutate its input"
    assert (out.images_dropped, out.reasoning_dropped) == (2, 2)
    rewritten = [it for it in out.items if it["type"] == "function_call_output"][:2]
    assert all(it not in items for it in rewritten) and all(it is not orig for it, orig in zip(rewritten, items))
    kept = [it for it in out.items if it["type"] != "function_call_output"] + [out.items[-1]]
    assert all(any(it is orig for orig in items) for it in kept)
    calls = [it for it in out.items if it["type"] == "function_call"]
    assert calls[0]["prompt_token_ids"] is items[2]["prompt_token_ids"]


def _vllm_check(bound_tokenizer: int, vocab_size: int):
    """vLLM's own `BaseRenderer.validate_token_ids`, on a renderer that holds only what it reads."""
    from vllm.renderers.base import BaseRenderer

    renderer = types.SimpleNamespace(tokenizer=types.SimpleNamespace(max_token_id=bound_tokenizer),
                                     model_config=types.SimpleNamespace(get_vocab_size=lambda: vocab_size))
    return lambda ids, parameter: BaseRenderer.validate_token_ids(renderer, ids, parameter=parameter)


def _outcome(check, ids):
    try:
        check(ids, "required_prefix_token_ids")
        return None
    except Exception as exc:
        return type(exc).__name__, str(exc), getattr(exc, "parameter", None)


@pytest.mark.parametrize("tokenizer_max,vocab_size", [(511, 512), (511, 600), (700, 512)])
def test_front_end_vocabulary_check_is_vllms(tokenizer_max, vocab_size):
    """The front end checks `required_prefix_token_ids` on the engine's bound (`VllmEngine.vocab_bound`'s
    formula) with vLLM's outcome, error class, message and parameter, for ids around both ends."""
    from minirl.generation.frontend import check_vocab

    bound = max(tokenizer_max, vocab_size - 1)
    vllm = _vllm_check(tokenizer_max, vocab_size)
    cases = [[], [0], [5, bound], [5, bound + 1], [bound + 1, -1], [-3, 2], [2**70], [3, 10**6, 4]]
    for ids in cases:
        assert _outcome(lambda i, p: check_vocab(i, bound, p), ids) == _outcome(vllm, ids), ids
    assert _outcome(lambda i, p: check_vocab(i, None, p), [-1, 10**9]) is None  # no tokenizer: vLLM checks nothing


def test_engine_client_checks_the_prefix_without_the_engines_process():
    """Before, each turn's prefix check was a blocking round trip to the engine's process (~1 ms of the front
    end's event loop a turn); now it answers with no engine at the channel's other end."""
    from minirl.generation import frontend

    tag = f"minirl-test-turn-path-{id(object())}"
    chan = frontend.Channel(f"ipc://@{tag}-e", f"ipc://@{tag}-f", bind=False)
    try:
        client = frontend.EngineClient(chan, max_model_len=128, version=0, vocab_bound=511)
        client.validate_token_ids([1, 2, 511], "required_prefix_token_ids")
        with pytest.raises(Exception, match="Token id 512 is out of vocabulary") as err:
            client.validate_token_ids([1, 512], "required_prefix_token_ids")
        assert err.value.parameter == "required_prefix_token_ids"
        assert not client._pending
    finally:
        chan.ctx.destroy(linger=0)


class OneStep:
    """A model whose first calls all wait for one engine step (`step`) and get a door tool call each; every
    later call ends its episode. `log` holds each call's ("call", key) and ("reply", key) in order."""

    EVIDENCE = {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [0.0]}

    def __init__(self):
        self.log: list[tuple[str, str]] = []
        self.step = asyncio.Event()
        self.waiting = 0

    async def chat(self, messages, tools, params, key, required_prefix):
        self.log.append(("call", key))
        if not key.endswith(".c0"):
            self.log.append(("reply", key))
            return ModelReply({"role": "assistant", "content": "done"}, "stop", self.EVIDENCE)
        self.waiting += 1
        await self.step.wait()
        self.log.append(("reply", key))
        fn = {"name": "open_door", "arguments": json.dumps({"code": 0})}
        message = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": fn}]}
        return ModelReply(message, "tool_calls", self.EVIDENCE)

    async def count_tokens(self, messages, tools, key, required_prefix):
        return 1


def test_an_answered_episode_sends_its_next_call_before_the_next_episode_reads_its_answer():
    """When one engine step answers several episodes at once, each sends its next call as soon as it has
    parsed its answer and stepped its environment. Before, a yield at the end of each turn made the first
    episode's next call wait until every answered episode had parsed its answer, with the engine idle."""
    cfg = load_config(overrides=[])
    model, n = OneStep(), 3
    rows = [{**prompt_row(cfg, 0, 0), "_minirl": {"step": 0, "group": 0, "rollout": r, "attempt": 0}}
            for r in range(n)]

    async def go():
        episodes = [asyncio.ensure_future(run_episode(row, cfg.agent, model)) for row in rows]
        while model.waiting < n:
            await asyncio.sleep(0)
        model.step.set()  # the engine step that answers all three
        return await asyncio.gather(*episodes)

    results = asyncio.run(go())
    assert [r["evidence"]["calls"] for r in results] == [2] * n
    keys = [Coords.from_row(row).key for row in rows]
    for this, after in zip(keys, keys[1:]):
        assert model.log.index(("call", f"{this}.c1")) < model.log.index(("reply", f"{after}.c0")), model.log


def test_a_request_that_comes_while_an_engine_steps_answers_is_read_before_the_last_answer_is_built():
    """An engine step answers many requests at once. Their handlers each build a response (~1 ms of the front
    end's loop); the next turn's first request, sent by the agent the first answer went to, used to wait until
    the last of them was built, with the engine idle. The front end now resolves one answer a loop iteration,
    so the loop reads its sockets between two: here the request (a byte on a socket, sent 2 ms after the first
    answer is built) is read after the answers built meanwhile, where it came after all twelve before."""
    import socket
    import threading
    import time

    from minirl.generation import frontend

    tag = f"minirl-test-answers-{id(object())}"
    engine_end = frontend.Channel(f"ipc://@{tag}-f", f"ipc://@{tag}-e", bind=True)
    chan = frontend.Channel(f"ipc://@{tag}-e", f"ipc://@{tag}-f", bind=False)
    loop = asyncio.new_event_loop()
    server_sock, agent_sock = socket.socketpair()
    log: list[str] = []
    try:
        client = frontend.EngineClient(chan, max_model_len=128, version=0, vocab_bound=511)
        client.loop = loop
        threading.Thread(target=loop.run_forever, daemon=True).start()

        async def handler(k: int) -> None:
            await asyncio.wrap_future(client.check_health())
            time.sleep(0.003)  # the response's JSON, on the loop
            log.append(f"answer {k}")
            if k == 0:  # the agent reads it, steps its environment and sends its next call
                threading.Timer(0.002, agent_sock.send, args=(b"x",)).start()

        async def wave() -> None:
            loop.add_reader(server_sock, lambda: (server_sock.recv(1), log.append("request")))
            handlers = [asyncio.ensure_future(handler(k)) for k in range(12)]
            await asyncio.sleep(0.05)  # every handler waits on the engine
            rids = list(client._pending)
            # one engine step's answers, handed over in a burst by the channel's thread
            threading.Thread(target=lambda: [client.resolve(rid, None, None) for rid in rids]).start()
            await asyncio.gather(*handlers)
            await asyncio.sleep(0.01)
            loop.remove_reader(server_sock)

        asyncio.run_coroutine_threadsafe(wave(), loop).result(timeout=30)
        assert len(log) == 13 and log[0] == "answer 0", log
        assert log.index("request") <= 6, log  # ~3: read after the answers built meanwhile
        assert not client._pending
    finally:
        loop.call_soon_threadsafe(loop.stop)
        server_sock.close()
        agent_sock.close()
        chan.ctx.destroy(linger=0)
        engine_end.ctx.destroy(linger=0)


class _Answer:
    """An engine result that notes which thread pickles it."""

    threads: list[str] = []

    def __reduce__(self):
        import threading

        _Answer.threads.append(threading.current_thread().name)
        return (_Answer, ())


def test_the_engine_thread_hands_each_answer_over_without_pickling_or_sending_it():
    """`FrontEnd._done` runs on the engine's thread as each request finishes, between two engine steps; it
    pickled and sent the answer there (~60 us a request). Now a thread of its own does both, in order."""
    import queue
    import threading
    from concurrent.futures import Future

    from minirl.generation import frontend

    tag = f"minirl-test-done-{id(object())}"
    engine_end = frontend.Channel(f"ipc://@{tag}-f", f"ipc://@{tag}-e", bind=True)
    front_end = frontend.Channel(f"ipc://@{tag}-e", f"ipc://@{tag}-f", bind=False)
    try:
        side = frontend.FrontEnd.__new__(frontend.FrontEnd)  # its engine-side half alone: no engine, no process
        side.chan, side._answers = engine_end, queue.SimpleQueue()
        threading.Thread(target=side._send_answers, name="answers", daemon=True).start()
        futures = [Future() for _ in range(3)]
        futures[0].set_result(_Answer())
        futures[1].set_exception(ValueError("refused"))
        futures[2].set_result(_Answer())
        for k, fut in enumerate(futures):
            side._done(f"r{k}", fut)
        got = [front_end.recv(timeout_s=10) for _ in futures]
        assert [m[:2] for m in got] == [("done", "r0"), ("done", "r1"), ("done", "r2")]
        assert isinstance(got[0][2], _Answer) and got[0][3] is None
        assert got[1][2] is None and isinstance(got[1][3], ValueError) and str(got[1][3]) == "refused"
        assert _Answer.threads == ["answers", "answers"]
    finally:
        front_end.ctx.destroy(linger=0)
        engine_end.ctx.destroy(linger=0)
