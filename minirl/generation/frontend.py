"""A generation worker's HTTP front end in its own process, talking to the engine's process over ZMQ.
The engine's process (the `GenerationWorker` Ray actor) only steps vLLM; everything HTTP runs in a
child process started by `FrontEnd`, whose `ModelServer` sees the engine through `EngineClient`.
So the front end's Python per request does not hold the GIL the engine loop needs, as `vllm serve`
keeps its API server apart from its EngineCore.

Invariants: the front end lives exactly as long as its worker (minirl.runtime.child), so `worker_kill`
kills the whole worker and Ray restarts it at the same port. The URL is returned only once the
front end serves; a front end that fails to start is a RuntimeError naming the worker, the address
and the cause. Every request the front end sends leaves its pending table exactly once.
"""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from concurrent.futures import Future

import zmq

from minirl.runtime import child

START_TIMEOUT_S = 300.0  # the front end imports vLLM's protocol classes and loads the tokenizer
CALL_TIMEOUT_S = 60.0


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle (vLLM's errors keep their `parameter`), else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(repr(exc))


class Channel:
    """One process's end: a PUSH socket out (any thread may send: sends are locked) and a PULL
    socket in (one thread reads). The engine's process binds, the front end connects.

    Why ZMQ: pyzmq ships with vLLM, which uses it for the same hop; messages arrive framed and in
    order; the I/O runs on ZMQ's own thread without the GIL, and the PUSH sockets have no high-water
    mark, so the engine thread's completion callbacks never wait for a slow front end; the sockets
    live in Linux's abstract namespace (`ipc://@...`), so a SIGKILLed worker leaves no files behind.
    A pipe would need our own framing and blocks its writer when full; shared memory our own framing
    and wake-ups, for messages of a few kB."""

    def __init__(self, out_addr: str, in_addr: str, bind: bool):
        self.ctx = zmq.Context(io_threads=1)
        self.out, self.inp = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        for sock, addr in ((self.out, out_addr), (self.inp, in_addr)):
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 2000)  # a last "failed" message still goes out on exit
            sock.bind(addr) if bind else sock.connect(addr)
        self._lock = threading.Lock()

    def send(self, *msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.out.send(data)

    def recv(self, timeout_s: float | None = None):
        """The next message, or None after `timeout_s`."""
        if timeout_s is not None and not self.inp.poll(int(timeout_s * 1000)):
            return None
        return pickle.loads(self.inp.recv())


# -- the engine's side (inside the GenerationWorker actor) -----------------------------------------
class FrontEnd:
    """Starts the front-end process and serves its requests to `engine` from one thread.

    The front end holds aiohttp, JSON, vLLM's pydantic protocol classes, the chat template, the tokenizer, the
    call log, the fault sites and `required_prefix_token_ids` (~2.5 ms of Python a request, off the engine's
    GIL), runs vLLM's InputProcessor on each request (its checks and its copy of the SamplingParams, ~0.1 ms),
    and detokenizes each finished generation with vLLM's own classes (minirl.generation.detokenize: the
    engine's steps skip that unless a request has stop strings), as `vllm serve`'s API process does both for
    its EngineCore. What crosses (pickled tuples): to the engine, the EngineCoreRequest in vLLM's own msgpack
    encoding (what vLLM sends its EngineCore; pickled when an int in it is too large for msgpack), aborts,
    health probes and the `engine_hang` / `engine_crash` / `engine_loop_crash` faults; back, each request's
    `GenResult` or its exception, and each probe's answer (None, or why the engine is unhealthy).
    `required_prefix_token_ids` is checked against the vocabulary in the front end (`check_vocab`, on the bound
    this process sends at start): a round trip here on every turn held the front end's event loop ~1 ms while it
    waited. The engine's process also calls into the front end (`call`): take the call log, reset for a new run,
    stats, the new weight version. `worker_kill` kills the front end's process at its site in `ModelServer`; the
    worker SIGKILLs its own process when the front end exits."""

    def __init__(self, engine, cfg, rank: int, host: str, port: int):
        from minirl.runtime.http_thread import resolve_host

        host = resolve_host(host)  # here, in the worker's process: the front-end process is no Ray worker
        tag = f"minirl-frontend-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        to_front, to_engine = f"ipc://@{tag}-f", f"ipc://@{tag}-e"
        self.engine, self.rank, self.where = engine, rank, f"{host}:{port}"
        self.chan = Channel(to_front, to_engine, bind=True)
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.serial_utils import MsgpackDecoder

        self._requests = MsgpackDecoder(EngineCoreRequest)
        spec = {"cfg": cfg, "rank": rank, "host": host, "port": port, "channel": (to_engine, to_front),
                "max_model_len": engine.max_model_len, "version": engine.version,
                "vocab_bound": engine.vocab_bound(), "processor_config": engine.processor_config()}
        self.proc = child.spawn("minirl.generation.frontend", spec)
        try:
            self.url = self._await_ready()
        except BaseException:
            self.proc.kill()
            raise
        self._answers: queue.SimpleQueue[tuple[str, Future]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, args=(self._serve_forever,), name=f"frontend-channel-{rank}",
                         daemon=True).start()
        threading.Thread(target=self._serve, args=(self._send_answers,), name=f"frontend-answers-{rank}",
                         daemon=True).start()
        child.die_with(self.proc, f"generation worker {rank}'s front end", "the worker")

    def _await_ready(self) -> str:
        what = f"generation worker {self.rank}'s HTTP front end (pid {self.proc.pid}) at {self.where}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            msg = self.chan.recv(timeout_s=0.5)
            if msg is not None and msg[0] == "ready":
                return msg[1]
            if msg is not None and msg[0] == "failed":
                raise RuntimeError(f"{what} failed to start: {msg[1]}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {self.proc.returncode} before serving "
                                   "(its stderr is in this worker's log)")
        raise RuntimeError(f"{what} did not serve within {START_TIMEOUT_S:.0f} s")

    def call(self, op: str, *args, timeout_s: float = CALL_TIMEOUT_S):
        """Run `op` (take_calls, reset, stats, version) in the front end, on its event loop; its result."""
        cid, fut = next(self._ids), Future()
        self._calls[cid] = fut
        self.chan.send("call", cid, op, args)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"generation worker {self.rank}'s front end did not answer {op} within {timeout_s} s") from None
        finally:
            self._calls.pop(cid, None)

    def _done(self, rid: str, fut: Future) -> None:
        """A request's answer, on the engine thread, which resolves the futures: handed to `_send_answers`.
        Pickled and sent here, it held the engine thread ~60 us a request between two steps (~6 ms of a
        default step's ~100 answers)."""
        self._answers.put((rid, fut))

    def _send_answers(self) -> None:
        while True:
            rid, fut = self._answers.get()
            exc = fut.exception()
            self.chan.send("done", rid, fut.result() if exc is None else None,
                           None if exc is None else _portable(exc))

    def _serve(self, body) -> None:
        try:
            body()
        except BaseException:  # nothing would answer the front end's requests again: end the worker, loudly
            traceback.print_exc()
            os.kill(os.getpid(), signal.SIGKILL)

    def _serve_forever(self) -> None:
        engine = self.engine
        while True:
            kind, key, *rest = self.chan.recv()
            if kind == "gen":
                request = rest[0] if not isinstance(rest[0], list) else self._requests.decode(rest[0])
                engine.generate(request, None, key).add_done_callback(lambda f, rid=key: self._done(rid, f))
            elif kind == "abort":
                engine.abort(key)
            elif kind == "health":
                self.chan.send("done", key, engine.check_health().result(), None)
            elif kind == "hang":
                engine.hang()
            elif kind == "crash":
                engine.crash(key)
            elif kind == "reply":
                fut = self._calls.get(key)
                value, exc = rest
                if fut is not None:
                    fut.set_exception(exc) if exc is not None else fut.set_result(value)


# -- the front end's side (its own process) ---------------------------------------------------------
def check_vocab(token_ids: list[int], bound: int | None, parameter: str) -> None:
    """vLLM's vocabulary check (`BaseRenderer.validate_token_ids`, vllm/renderers/base.py), its
    error and wording, against `bound` (`VllmEngine.vocab_bound`; None: vLLM checks nothing)."""
    if not token_ids or bound is None:
        return
    from vllm.exceptions import VLLMValidationError

    low, high = min(token_ids), max(token_ids)
    if low < 0:
        raise VLLMValidationError(f"Token id {low} is out of vocabulary", parameter=parameter)
    if high > bound:
        raise VLLMValidationError(f"Token id {high} is out of vocabulary", parameter=parameter)


def make_request(processor, rid: str, prompt_token_ids: list[int], params):
    """The EngineCoreRequest vLLM's `processor` (an InputProcessor) makes of token ids: the renderer's
    prompt first, as `process_inputs` made it of a raw prompt (raising what vLLM refuses)."""
    (prompt,) = processor.renderer.render_cmpl([{"prompt_token_ids": prompt_token_ids}])
    return processor.process_inputs(rid, prompt, params, supported_tasks=("generate",))


class EngineClient:
    """The engine as `ModelServer` sees it, across the channel: `VllmEngine`'s interface
    (generate -> Future, abort, check_health -> Future, hang, crash, validate_token_ids, max_model_len,
    version). `validate_token_ids` runs here, against the engine's `vocab_bound`; so does vLLM's
    InputProcessor, built from the engine's own config (`VllmEngine.processor_config`): its checks and
    its refusals (400s naming the field) happen in this process, and the engine's thread only adds the
    EngineCoreRequest it makes, ~0.1 ms less a request between two of its steps."""

    def __init__(self, chan: Channel, max_model_len: int, version: int, vocab_bound: int | None,
                 processor_config=None):
        """`processor_config`: `VllmEngine.processor_config()` (None: a client that generates nothing)."""
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.serial_utils import MsgpackEncoder

        self.chan, self.max_model_len, self.version = chan, max_model_len, version
        self.vocab_bound = vocab_bound
        self._pending: dict[str, Future] = {}
        self.loop = None  # the HTTP server's loop (`main`): answers resolve on it, one a loop iteration
        self._answers: deque[tuple] = deque()
        self._answers_lock = threading.Lock()
        self.processor = None if processor_config is None else InputProcessor(processor_config)
        self._encode = MsgpackEncoder().encode

    def _ask(self, kind: str, rid: str, *payload) -> Future:
        fut: Future = Future()
        self._pending[rid] = fut
        self.chan.send(kind, rid, *payload)
        return fut

    def generate(self, prompt_token_ids: list[int], params, request_id: str | None = None) -> Future:
        """vLLM's InputProcessor makes the request (raising what vLLM refuses), sent in vLLM's own msgpack
        encoding, as `vllm serve` sends its EngineCore (pickled when an int in it is too large for msgpack)."""
        rid = request_id or uuid.uuid4().hex
        request = make_request(self.processor, rid, prompt_token_ids, params)
        try:
            encoded = [bytes(frame) for frame in self._encode(request)]
        except OverflowError:
            encoded = request
        return self._ask("gen", rid, encoded)

    def abort(self, request_id: str) -> None:
        fut = self._pending.pop(request_id, None)
        if fut is not None:
            fut.cancel()
            self.chan.send("abort", request_id)

    def check_health(self) -> Future:
        return self._ask("health", uuid.uuid4().hex)

    def hang(self) -> None:
        self.chan.send("hang", "")

    def crash(self, where: str = "step") -> None:
        self.chan.send("crash", where)

    def validate_token_ids(self, token_ids: list[int], parameter: str) -> None:
        check_vocab(token_ids, self.vocab_bound, parameter)

    def resolve(self, rid: str, value, exc: BaseException | None) -> None:
        """An answer from the engine (on the channel's thread), resolved on the server's loop, one a loop
        iteration (`_resolve_one`). An engine step finishes many requests at once; resolved together,
        their handlers all built their responses in one iteration of the loop (~1 ms each), and the
        next turn's first request, back from its agent within ~2 ms, waited for the last of them with
        the engine idle. One a loop iteration, the loop reads the sockets between two responses."""
        with self._answers_lock:
            self._answers.append((rid, value, exc))
            first = len(self._answers) == 1
        if first:
            self.loop.call_soon_threadsafe(self._resolve_one)

    def _resolve_one(self) -> None:
        with self._answers_lock:
            rid, value, exc = self._answers.popleft()
            more = bool(self._answers)
        if more:
            self.loop.call_soon(self._resolve_one)  # the next iteration, after the loop polls its sockets
        fut = self._pending.pop(rid, None)
        if fut is None or not fut.set_running_or_notify_cancel():  # aborted meanwhile
            return
        fut.set_exception(exc) if exc is not None else fut.set_result(value)


def main() -> None:
    spec = child.child_spec()
    chan = Channel(*spec["channel"], bind=False)
    cfg = spec["cfg"]
    try:
        from transformers import AutoTokenizer

        from minirl.faults import FaultPlan
        from minirl.generation.server import ModelServer
        from minirl.runtime.http_thread import HttpThread

        engine = EngineClient(chan, spec["max_model_len"], spec["version"], spec["vocab_bound"],
                              spec["processor_config"])
        tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_name)
        server = ModelServer(engine, tokenizer, cfg.policy.model_name, FaultPlan(cfg.faults))
        server.reasoning_parser = cfg.policy.generation.reasoning_parser

        async def setup():
            return server.app(cfg.policy.generation.vllm_cfg.max_request_bytes)

        http = HttpThread(setup, spec["host"], spec["port"], name=f"model-server-{spec['rank']}")
        engine.loop = http.loop  # before "ready": no one has the URL yet, so no answer comes before it
    except BaseException as exc:
        chan.send("failed", f"{type(exc).__name__}: {exc}")
        chan.ctx.destroy(linger=2000)
        sys.exit(1)

    def reset(plan, reasoning_parser) -> None:
        server.plan, server.reasoning_parser = plan, reasoning_parser
        server.calls.clear()
        server.hung = False  # a `worker_hang` of the previous run (sweeps reuse workers) ends with it

    def set_version(version: int) -> None:
        engine.version = version

    ops = {"take_calls": server.take_calls, "finish_run": server.calls.finish, "reset": reset, "version": set_version,
           "stats": lambda: {"tokens": server.tokens_generated, "calls_dropped": server.calls.dropped,
                             "unkeyed_calls_dropped": server.calls.unkeyed_dropped}}

    def control(cid: int, op: str, args: tuple) -> None:  # on the server's loop, which owns its state
        try:
            chan.send("reply", cid, ops[op](*args), None)
        except Exception as exc:
            chan.send("reply", cid, None, _portable(exc))

    chan.send("ready", http.url)
    while True:
        kind, key, *rest = chan.recv()
        if kind == "done":
            engine.resolve(key, *rest)
        else:  # "call"
            http.loop.call_soon_threadsafe(control, key, *rest)


if __name__ == "__main__":
    main()
