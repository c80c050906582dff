"""The rollout manager: runs a step's prompt groups through `POST /run` under the failure policy
(NeMo-RL's `generate_and_push`, plus minirl's fixes): retries with backoff, row and group
redispatch, drop and skip budgets, one deadline per group attempt. `run_group` lists the rules.

Invariant: a group's outcome holds only rollouts whose own `/run` succeeded and validated; every
failure, retry, drop, skip and raise is written to the event log with its coordinates.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import aiohttp

from minirl.runtime import jsonio
from minirl.config import MinirlConfig
from minirl.data import difficulty, run_body
from minirl.faults import FAULT_KINDS, FaultPlan
from minirl.gym.failures import error_failure, failure_facts
from minirl.rollout.agent_pool import AgentPool
from minirl.rollout.evidence import parse_rollout, reward_bound
from minirl.timeline import Occupancy
from minirl.types import GroupOutcome, Rollout
from minirl.wire import (
    Coords,
    DATA,
    INFRA,
    AgentBadAnswer,
    AgentUnreachable,
    DeterministicFailure,
    GymTransportError,
    ERROR_BODY_LIMIT,
    RolloutDataFailure,
    RolloutFailure,
    RolloutRedispatchExhausted,
    RolloutStall,
    RolloutTimeout,
    classify,
    parse_error_body,
)

Emit = Callable[[dict], None]


@dataclass
class GroupRun:
    """One prompt group's run under the failure policy: the outcome being built, each row's send
    count (its next attempt id), the group's INFRA and DATA failure counts, the current group id."""

    step: int
    group: int
    row: dict
    out: GroupOutcome
    row_attempt: list[int]
    on_attempt: Callable[[int | None], Awaitable[int]] | None = None
    infra: int = 0
    data: int = 0
    gid: str = ""
    streaks: dict = field(default_factory=dict)  # row -> (its last failure's answer, sends in a row that gave it)
    ended: dict = field(default_factory=dict)  # row -> the failure that ended its sends in this group attempt
    sending: dict = field(default_factory=dict)  # row -> (agent server, monotonic time) of its send in flight
    last_url: dict = field(default_factory=dict)  # row -> the agent server its last failed send went to
    weight: int | None = None  # async: the policy version the current group attempt started under
    row_weight: dict = field(default_factory=dict)  # row -> `weight` of the attempt its kept result came from

    def oldest_kept(self) -> int | None:
        """The oldest attempt version among the rows kept so far (None: none kept, or sync)."""
        return min((self.row_weight[r] for r in self.out.rollouts if r in self.row_weight), default=None)


JSON_HEADERS = {"Content-Type": "application/json"}
PROBE_TIMEOUT_S = 5.0
"""A down agent server's probe (`GET /health`) not answered within this leaves it down."""


def run_session() -> aiohttp.ClientSession:
    """The session `/run` calls go through (created on the event loop that uses it). No total timeout:
    aiohttp's default (300 s) would end a longer `/run` with a bare TimeoutError outside the failure policy;
    a `/run` is bounded by `nemo_gym.rollout_timeout_s` alone (None, upstream's default: unbounded)."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
                                 connector=aiohttp.TCPConnector(limit=0))


async def post_run(session: aiohttp.ClientSession, url: str, row: dict) -> dict:
    """One `/run` call, mapped onto the taxonomy (upstream's nemo_gym.py wording). The error body's
    typed `type` field travels on the failure as `error_type`."""
    coords = Coords.from_row(row)  # a held-out (validation) row has none
    what = f"NeMo-Gym /run for {coords.key if coords else 'row ' + str(row.get('_rowidx'))}"
    try:
        async with session.post(url + "/run", data=jsonio.dumps(row), headers=JSON_HEADERS) as resp:
            status, body, content_type = resp.status, await resp.read(), resp.headers.get("Content-Type", "")
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
            ConnectionError) as exc:
        raise AgentUnreachable(f"{what} failed in transport: {exc!r}") from exc  # refused or reset: down or restarting
    except aiohttp.ClientError as exc:
        raise GymTransportError(f"{what} failed in transport: {exc!r}") from exc
    if status != 200:
        error, error_type = parse_error_body(body)
        where = f" (POST {url}/run)" if status in (404, 405) else ""  # a misdirected URL: name it
        message = f"NeMo-Gym /run failed with HTTP {status}: {error}{where}"
        failure = error_failure(status, body, message, error_type)  # the body's `terminal`, else the status
        failure.status = status  # what the agent server answered (classify reads the class first)
        raise failure
    try:
        return jsonio.loads(body)  # json's results and errors, with msgspec's speed
    except ValueError as exc:
        opening = body[:80].decode("utf-8", "replace")
        raise AgentBadAnswer(f"malformed /run result: {what} returned invalid JSON from the agent server at {url} "
                             f"({exc}; Content-Type {content_type!r}, the body opens {opening!r})") from exc
    except RecursionError:  # json's C parser refuses a body nested past the interpreter's limit
        raise RolloutDataFailure(f"malformed /run result: {what} returned JSON nested deeper than it parses") from None


def identical_answer(exc: BaseException) -> tuple[int, str] | None:
    """What makes two failed sends the same answer: the agent server's 5xx status and its error text.
    None for a failure that may pass on its own: no answer at all, a 4xx (DATA already), a gateway's
    502-504, an unreachable model server (a restarting worker), a context guard's rejection."""
    status = getattr(exc, "status", None)
    if (not isinstance(exc, GymTransportError) or not isinstance(status, int) or status < 500
            or status in (502, 503, 504)):
        return None
    if exc.error_type in ("GenerationUnavailable", "ContextGuardRejected"):
        return None
    return status, str(exc)


RESTART_POLL_S = 1.0
"""The shortest wait between a group's attempts in its restart window (past max_infra_attempts_per_prompt):
the window is measured in the waits, and under `backoff_base_s=0` the group retried for ever."""


def restart_window(rf, failures: list[BaseException]) -> float:
    """The backoff, in seconds, that a group whose attempt failed with `failures` may spend past
    `max_infra_attempts_per_prompt` waiting for a restart: `agent_restart_window_s` when no row reached
    an agent server, `generation_restart_window_s` when every row's agent reached no model server
    (minirl's agents say GenerationUnavailable); else 0."""
    if all(isinstance(e, AgentUnreachable) for e in failures):
        return rf.agent_restart_window_s
    if all(getattr(e, "error_type", None) == "GenerationUnavailable" for e in failures):
        return rf.generation_restart_window_s
    return 0.0


def will_not_pass(exc: BaseException) -> bool:
    """Whether sending the row again cannot help: a deterministic failure, or one whose own facts say
    terminal (Gym's EpisodeFailure, a 4xx of minirl's pool). Such a failure decides its group (DATA:
    skipped or raised) over a sibling's INFRA failure, so the row is never re-sent."""
    return isinstance(exc, DeterministicFailure) or getattr(exc, "terminal", None) is True


_DIGITS = re.compile(r"\d+")
CAUSE_HINTS = (
    ("uses_reasoning_parser", "the model server's reasoning parser and the agent's uses_reasoning_parser disagree: "
                              "set policy.generation.reasoning_parser to match"),
    ("context_length", "prompts exceed max_model_len (policy.generation.vllm_cfg.max_model_len)"),
    ("maximum context length", "prompts exceed max_model_len (policy.generation.vllm_cfg.max_model_len)"),
    ("AgentUnreachable", "no agent server accepted a connection: down, or not back within "
                         "async_rl.rollout_failure.agent_restart_window_s"),
    ("GenerationUnavailable", "no generation worker answered: down, or not back within "
                              "async_rl.rollout_failure.generation_restart_window_s"),
)


def dominant_failure(reasons: list[str]) -> str:
    """The most common failure among lost groups' reasons (`Class: message`, numbers set aside),
    as one sentence for a run-ending error, with the likely cause where the text names a known one."""
    if not reasons:
        return "No lost group recorded a failure."
    shape = [_DIGITS.sub("#", r) for r in reasons]  # coordinates, ports and positions set aside
    (key, k), = Counter(shape).most_common(1)
    reason = reasons[len(shape) - 1 - shape[::-1].index(key)]  # the latest of them, as written
    share = f"all {k} lost group(s)" if k == len(reasons) else f"{k} of {len(reasons)} lost groups"
    hint = next((h for marker, h in CAUSE_HINTS if marker in reason), None)
    text = " ".join(reason.split())  # one line: it ends up in the run's last stderr line
    text = text if len(text) <= 800 else text[:800] + "..."
    return f"Dominant failure ({share}): {text}" + (f" [likely cause: {hint}]" if hint else "")


def backoff(rf, k: int) -> float:
    """Delay before INFRA retry k (k = INFRA attempts failed so far, from 1), under `rf` (a
    RolloutFailureConfig): training's rows and validation's held-out rows wait alike."""
    return min(rf.backoff_base_s * 2 ** (k - 1), rf.max_backoff_s)


class RolloutManager:
    def __init__(
        self,
        cfg: MinirlConfig,
        agent_urls: list[str],
        emit: Emit,
        vocab_size: int,
        sleep: Callable[[float], Awaitable] = asyncio.sleep,
        post: Callable[..., Awaitable[dict]] = post_run,
    ):
        self.cfg, self.agent_urls, self.emit, self.vocab_size = cfg, agent_urls, emit, vocab_size
        self.pool = AgentPool.of(agent_urls, cfg.agent)
        self.probes: set[asyncio.Task] = set()  # down agent servers' probes in flight
        self.agent_sends: Counter = Counter()  # /run sends per agent server since the last agent_stats()
        self.lost: deque[str] = deque(maxlen=64)  # the reasons of the groups lost since the last commit
        self.sleep, self.post = sleep, post
        self.rf = cfg.async_rl.rollout_failure
        cc = cfg.context_compaction
        self.can_redispatch = not cc.enabled or cc.redispatch_dropped_groups
        self.plan = FaultPlan(cfg.faults)
        self.consecutive_drops = 0  # run-scoped, as upstream: reset by every committed group
        self.skipped = 0  # run-scoped skip budget use
        self.reservations: dict[str, tuple[int, int]] = {}
        self.in_flight: dict[str, float] = {}
        self.occupancy = Occupancy()  # wall time with any rollout in flight (minirl.timeline)
        self.last_progress = time.monotonic()
        self.unsettled: dict[tuple[int, int], GroupOutcome] = {}  # (step, group) -> begun, in no step's metrics yet
        self.session: aiohttp.ClientSession | None = None
        self.max_abs_reward = reward_bound(cfg.grpo.normalize_rewards)

    def state(self) -> dict:
        return {"consecutive_drops": self.consecutive_drops, "skipped": self.skipped}

    def load_state(self, state: dict) -> None:
        self.consecutive_drops, self.skipped = state["consecutive_drops"], state["skipped"]

    def unsettle(self, outcomes: list[GroupOutcome]) -> None:
        """Groups a checkpoint carried over (an async resume's buffer): begun, in no step's metrics yet."""
        for o in outcomes:
            self.unsettled[o.step, o.group] = o

    def settle(self, outcomes: list[GroupOutcome]) -> None:
        """These groups are counted in a step's metrics: they leave `unsettled`."""
        for o in outcomes:
            self.unsettled.pop((o.step, o.group), None)

    def spent(self) -> tuple[int, int]:
        """(sends, valid results) of every group begun and not yet in a step's metrics: what a run
        that ends now spent since its last step's metrics (run_failed)."""
        return sum(o.row_sends for o in self.unsettled.values()), sum(o.rows_returned for o in self.unsettled.values())

    # -- a step ----------------------------------------------------------------------------------
    def open(self) -> None:
        """The HTTP session (created on the event loop that will use it)."""
        if self.session is None:
            self.session = run_session()
        self.last_progress = time.monotonic()

    async def run_step(self, step: int, rows: list[dict],
                       on_resolved: Callable[[], None] | None = None) -> list[GroupOutcome]:
        """All groups concurrently; the first run-ending error cancels the rest and propagates.
        `on_resolved` runs as each group but the last resolves without error (never in a step of one
        group): the sync source takes the step's call records so far meanwhile, so the take after the
        step carries only those of its last calls."""
        self.open()
        tasks = [asyncio.create_task(self.run_group(step, g, row)) for g, row in enumerate(rows)]
        if on_resolved is not None and len(tasks) > 1:
            resolved = Counter()

            def tally(task: asyncio.Task) -> None:
                if not task.cancelled() and task.exception() is None:
                    resolved["groups"] += 1
                    if resolved["groups"] < len(tasks):
                        on_resolved()

            for t in tasks:
                t.add_done_callback(tally)
        watchdog = asyncio.create_task(self.watchdog(step))
        try:
            done_or_stall = asyncio.gather(*tasks)
            finished, _ = await asyncio.wait([done_or_stall, watchdog], return_when=asyncio.FIRST_COMPLETED)
            if watchdog in finished:
                watchdog.result()  # raises RolloutStall
            return done_or_stall.result()
        finally:
            watchdog.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, watchdog, return_exceptions=True)

    async def watchdog(self, step: int | Callable[[], int]) -> None:
        """Raise RolloutStall (or warn) when nothing in flight has completed for stall_timeout_s: timed from
        the last completion, or from the oldest send in flight if later (an async pump idles between steps
        with nothing in flight: that wait is no stall). Its `stall` event names `step`: the synchronous
        step, or (a callable, the async pump's, which runs one watchdog for the whole run) the step it
        returns when the event is written."""
        wd = self.cfg.async_rl.stall_watchdog
        if wd.stall_timeout_s is None:
            await asyncio.Event().wait()
        while True:
            await asyncio.sleep(min(1.0, wd.stall_timeout_s / 4))
            if not self.in_flight:
                continue
            idle = time.monotonic() - max(self.last_progress, min(self.in_flight.values()))
            if idle > wd.stall_timeout_s:
                oldest = sorted(self.in_flight.items(), key=lambda kv: kv[1])[:8]
                what = ", ".join(f"{k} ({time.monotonic() - t0:.0f}s)" for k, t0 in oldest)
                message = (
                    f"no rollout completed for {idle:.1f}s (async_rl.stall_watchdog.stall_timeout_s="
                    f"{wd.stall_timeout_s}); {len(self.in_flight)} in flight: {what}"
                )
                at = step() if callable(step) else step
                self.emit({"type": "stall", "step": at, "in_flight": len(self.in_flight), "decision": wd.action,
                           "message": message})
                if wd.action == "raise":
                    raise RolloutStall(message)
                print(f"warning: {message}", flush=True)
                self.last_progress = time.monotonic()

    # -- a group ---------------------------------------------------------------------------------
    async def run_group(self, step: int, group: int, row: dict,
                        on_attempt: Callable[[int | None], Awaitable[int]] | None = None) -> GroupOutcome:
        """One prompt group under the failure policy. `on_attempt` (the async pump's) is awaited as
        each group attempt starts, where upstream reserves the attempt under the current version,
        with the oldest version among the rows kept from earlier attempts (None: none), and returns
        the version the attempt starts under (once no weight sync is under way: a retry is a dispatch
        too); the outcome's `start_weight` is then the oldest version any of its kept rows' attempts
        started under.

        - every group attempt reserves a fresh group id and releases it, whatever happens;
        - an INFRA failure is retried after min(backoff_base_s * 2**(k-1), max_backoff_s), up to
          `max_infra_attempts_per_prompt` attempts; then the group is dropped, and more than
          `max_consecutive_dropped_prompts` drops with no commit in between raise
          RolloutRedispatchExhausted;
        - a DATA failure is retried without backoff up to `max_data_attempts_per_prompt`, then skipped
          within `max_skipped_prompts` (past it, upstream's skip-budget error), or re-raised unchanged at 0;
        - which failure decides an attempt whose rows failed differently: one that will not pass, then a
          DATA one over an INFRA one (the row's own answer recurs whatever the fleet does), whatever the
          rows' order;
        - within a group attempt, a row that failed with INFRA is re-sent alone, up to
          `nemo_gym.max_row_attempts` sends; siblings that came back keep their results (row redispatch),
          and keep them across group attempts too unless `nemo_gym.keep_returned_rows=false` (upstream);
        - each send goes to the agent server the pool picks (minirl.rollout.agent_pool); a refused
          connection, a 200 that is not JSON (`AgentBadAnswer`, re-sent at once on another server where
          one is up) and a send left unanswered at the deadline count against that server, and a down
          server is probed in the background (`agent_down` / `agent_up` events);
        - `nemo_gym.rollout_timeout_s` is one deadline per group attempt, row re-sends included
          (upstream's "NeMo-Gym prompt group exceeded {s}s"); rows that came back before it keep theirs;
        - under context compaction with `redispatch_dropped_groups=false` (upstream), nothing is re-sent:
          the first failure drops the group (INFRA) or goes straight to skip-or-raise (DATA);
        - a group whose rollouts are all masked has no valid owner: under CC it is dropped, with that
          reason, against the same consecutive-drop budget; without CC it trains with zero loss (upstream);
          the step's ledger, which masks after commit, drops such a group too (`drop_unowned`);
        - cancellation is never retried; it propagates after the reservations are released.
        """
        run = GroupRun(step, group, row, GroupOutcome(group, "committed", step=step),
                       [0] * self.cfg.grpo.num_generations_per_prompt, on_attempt)
        self.unsettled[step, group] = run.out
        while True:
            failures = await self._group_attempt(run)
            if not failures:
                return self._resolved(run)
            # one that will not pass decides, then a DATA failure over an INFRA one: never the rows' order
            failures.sort(key=lambda f: (not will_not_pass(f[1]), classify(f[1]) != DATA))
            kind = classify(failures[0][1])
            ended = await (self._after_infra(run, failures) if kind == INFRA else self._after_data(run, failures))
            if ended is not None:
                return ended

    async def _group_attempt(self, run: GroupRun) -> list[tuple[Coords, BaseException]]:
        """One group attempt under a fresh group id, reserved while it runs: its rows' final failures."""
        out = run.out
        if out.group_attempts and not self.rf.nemo_gym.keep_returned_rows:
            for rollout in out.rollouts.values():  # upstream: a group retry re-runs every row
                self.emit({"type": "discard", **rollout.coords.as_dict(), "reason": "group_retry",
                           "decision": "rerun", "group_attempt": out.group_attempts + 1})
            out.rollouts = {}
        run.gid = f"grp-{uuid.uuid4().hex[:12]}"
        self.reservations[run.gid] = (run.step, run.group)
        out.group_attempts += 1
        try:
            if run.on_attempt is not None:
                run.weight = await run.on_attempt(run.oldest_kept())
            return await self._attempt(run)
        finally:
            del self.reservations[run.gid]

    async def _after_infra(self, run: GroupRun, failures) -> GroupOutcome | None:
        """An INFRA failure: back off and retry (None), or drop the group against the drop budget."""
        exc = failures[0][1]
        run.infra += 1
        # no agent server reached, or no model server behind it: one may be restarting, so the group waits out
        # the restart window
        window_s = restart_window(self.rf, [e for _, e in failures])
        restarting = run.out.backoff_s < window_s
        if self.can_redispatch and (run.infra < self.rf.max_infra_attempts_per_prompt or restarting):
            past_budget = run.infra >= self.rf.max_infra_attempts_per_prompt
            # the window is the waits' sum: in it a wait is at least RESTART_POLL_S, or a backoff of 0 never ends it
            delay = max(backoff(self.rf, run.infra), RESTART_POLL_S if past_budget else 0.0)
            window = {"restart_window_s": window_s} if past_budget else {}
            self._failed(run.out, failures, "retried", backoff_s=delay, group_attempt=run.gid, **window)
            run.out.backoff_s += delay
            await self.sleep(delay)
            return None
        # the rows' events carry the group's fate: a drop past the budget ends the run (its `drop` event: raised)
        self._failed(run.out, failures, "raised" if self._drop_raises() else "dropped", group_attempt=run.gid)
        message = self._exhausted_message(run.step, run.group, run.infra, exc)
        return self._drop(run.step, run.group, run.out, exc, message)

    async def _after_data(self, run: GroupRun, failures) -> GroupOutcome | None:
        """A DATA failure: retry without backoff (None), skip within the skip budget, or raise."""
        exc = failures[0][1]
        run.data += 1
        retry = not will_not_pass(exc)  # the same answer again, or Gym's terminal failure: never retried
        if retry and self.can_redispatch and run.data < self.rf.max_data_attempts_per_prompt:
            self._failed(run.out, failures, "retried", backoff_s=0.0, group_attempt=run.gid)
            return None
        if self.skipped < self.rf.max_skipped_prompts:
            self.skipped += 1
            self._failed(run.out, failures, "skipped", group_attempt=run.gid)
            run.out.status, run.out.reason, run.out.rollouts = "skipped", f"{type(exc).__name__}: {exc}", {}
            self.emit({"type": "skip", "step": run.step, "group": run.group, "rollout": None, "attempt": None,
                       "reason": run.out.reason, "skipped": self.skipped, "decision": "skipped"})  # as a drop's line
            self.lost.append(run.out.reason)
            return run.out
        self._failed(run.out, failures, "raised", group_attempt=run.gid)
        if self.rf.max_skipped_prompts == 0:
            raise exc  # upstream: at a zero skip budget the original failure propagates unchanged
        raise RolloutDataFailure(
            f"skipped {self.skipped} prompts and this one also exhausted its data budget, exceeding "
            f"max_skipped_prompts={self.rf.max_skipped_prompts}; the dataset or sequence-length configuration "
            f"is likely wrong. {dominant_failure([*self.lost, f'{type(exc).__name__}: {exc}'])}"
        ) from exc

    def _resolved(self, run: GroupRun) -> GroupOutcome:
        """Every row came back: commit the group, unless under CC it has no valid owner (a drop)."""
        if self._unowned(run.out):
            return self._drop_unowned(run.step, run.group, run.out, "")
        self.consecutive_drops = 0
        self.lost.clear()
        return run.out

    def drop_unowned(self, outcomes: list[GroupOutcome]) -> set[tuple[int, int]]:
        """After the step's ledger masks: a committed group whose rollouts the ledger's masks (unrecorded,
        stale or mismatched calls) left all masked has no valid owner either, and under CC is dropped as one
        found at commit is, against the same budget. Its commit reset the count, so the drop is charged where
        it is found, after the commits since. Returns the dropped groups' (step, group)."""
        unowned = [o for o in outcomes if o.status == "committed" and self._unowned(o)]
        for o in unowned:
            self._drop_unowned(o.step, o.group, o, " by the step's ledger")
        return {(o.step, o.group) for o in unowned}

    def _unowned(self, out: GroupOutcome) -> bool:
        return self.cfg.context_compaction.enabled and all(r.sample_mask == 0 for r in out.rollouts.values())

    def _drop_unowned(self, step: int, group: int, out: GroupOutcome, where: str) -> GroupOutcome:
        """Upstream under CC: a group with no valid owner is dropped, against the consecutive-drop budget."""
        reasons = ", ".join(sorted({r.mask_reason for r in out.rollouts.values()}))
        exc = RolloutDataFailure(f"no valid owner: every rollout of the group is masked{where} ({reasons})")
        message = (f"{self.prompt_name(step, group)} has no valid owner (every rollout masked{where}: {reasons}), "
                   f"and this was drop {self.consecutive_drops + 1} with no rollout committed in between, exceeding "
                   f"max_consecutive_dropped_prompts={self.rf.max_consecutive_dropped_prompts}")
        return self._drop(step, group, out, exc, message)

    def prompt_name(self, step: int, group: int) -> str:
        """Upstream's `prompt idx={idx}`: the prompt's position in the prompt stream (its dataset
        index), not its slot in the step: group g of step s is prompt s * num_prompts_per_step + g.
        A spare (async `replacement_prompt_source=spare_groups`: group N + g of prompt step b) is in
        no step's stream, so it is named by its own coordinates, never as step b + 1's group g."""
        n = self.cfg.grpo.num_prompts_per_step
        return f"prompt idx={step * n + group}" if group < n else f"spare prompt (step {step}, group {group})"

    def _exhausted_message(self, step: int, group: int, attempts: int, exc: BaseException) -> str:
        return (
            f"{self.prompt_name(step, group)} exhausted its infrastructure retry budget "
            f"after {max(attempts, 1)} attempt(s) "
            f"(max_infra_attempts_per_prompt={self.rf.max_infra_attempts_per_prompt}), and this was drop "
            f"{self.consecutive_drops + 1} with no rollout committed in between, exceeding "
            f"max_consecutive_dropped_prompts={self.rf.max_consecutive_dropped_prompts}; the generation fleet is not "
            f"recovering. Last failure was {type(exc).__name__}: {exc}"
        )

    def _drop_raises(self) -> bool:
        """Whether the next drop is past `max_consecutive_dropped_prompts` (it ends the run)."""
        return self.consecutive_drops + 1 > self.rf.max_consecutive_dropped_prompts

    def _drop(self, step: int, group: int, out: GroupOutcome, exc: BaseException, exhausted: str) -> GroupOutcome:
        """Charge a drop to the run-scoped budget; past it, raise `exhausted`, chained to `exc`."""
        over = self._drop_raises()
        self.consecutive_drops += 1
        self.emit({"type": "drop", "step": step, "group": group, "rollout": None, "attempt": None,  # the whole group
                   "reason": f"{type(exc).__name__}: {exc}",
                   "consecutive_drops": self.consecutive_drops, "decision": "raised" if over else "dropped"})
        self.lost.append(f"{type(exc).__name__}: {exc}")
        if over:
            raise RolloutRedispatchExhausted(f"{exhausted}. {dominant_failure(list(self.lost))}") from exc
        out.status, out.reason, out.rollouts = "dropped", f"{type(exc).__name__}: {exc}", {}
        return out

    def _failed(self, out: GroupOutcome, failures, decision: str, **extra) -> None:
        """A `failure` event for each row of a group decision, each with its own class (the decision
        may be a sibling's: a row that failed INFRA is skipped with a terminal sibling)."""
        for coords, exc in failures:
            self._failure_event(out, coords, classify(exc), exc, decision, **extra)

    def _failure_event(self, out: GroupOutcome, coords: Coords, kind: str, exc: BaseException, decision: str,
                       **extra) -> None:
        """A row's failed send: its `failure` event, counted on its group's outcome."""
        error_type = getattr(exc, "error_type", None)
        out.guard_rejections += error_type == "ContextGuardRejected"
        agent = {"agent": exc.agent_url} if getattr(exc, "agent_url", None) else {}  # the agent server that failed it
        facts = failure_facts(exc)
        failure_kind = facts.get("failure_kind") or "unknown"
        out.failures_by_kind[failure_kind] = out.failures_by_kind.get(failure_kind, 0) + 1
        self.emit({"type": "failure", **coords.as_dict(), "class": kind, "reason": type(exc).__name__,
                   "error_type": error_type, "error": str(exc)[:ERROR_BODY_LIMIT], "decision": decision,
                   **facts, **agent, **extra})
        if error_type == "SummaryFailed":  # a harness failure (INFRA): retried as any other, never a reward of 0
            out.summaries_failed += 1
            self.emit({"type": "summary_failed", **coords.as_dict(), "class": kind, "decision": decision})

    async def _attempt(self, run: GroupRun) -> list[tuple[Coords, BaseException]]:
        """Send every row the group still lacks, under the group deadline; return the rows' final
        failures (empty: success). A row that came back stays in `out.rollouts` even past the deadline."""
        out, row_attempt = run.out, run.row_attempt
        G = self.cfg.grpo.num_generations_per_prompt
        pending = [r for r in range(G) if r not in out.rollouts]
        deadline = self.rf.nemo_gym.rollout_timeout_s
        before = list(row_attempt)
        run.ended = {}
        run.sending.clear()
        try:
            async with asyncio.timeout(deadline):
                results = await asyncio.gather(*(self._row(run, r) for r in pending), return_exceptions=True)
        except TimeoutError:
            for r in pending:  # a row the deadline caught before its first send still gets an attempt id of its own
                row_attempt[r] += row_attempt[r] == before[r]
            return self._timed_out(run, [r for r in range(G) if r not in out.rollouts])
        failures = []
        for res in results:
            if isinstance(res, BaseException):  # cancellation, or a bug: never a row failure
                raise res
            if isinstance(res, tuple):
                failures.append(res)
        return failures

    def _timed_out(self, run: GroupRun, rows: list[int]) -> list[tuple[Coords, BaseException]]:
        """The group deadline caught `rows`: each row still sending (or not yet sent) a RolloutTimeout naming
        the agent server its send was on, and each server that held one and answered nothing meanwhile
        charged a `timeout`; each row whose sends had already failed, its own failure."""
        failures, silent = [], {}
        for r in rows:
            # a row whose sends ended before the deadline keeps its own failure, so its class decides as
            # it would have without the deadline (a terminal one decides the group; DATA stays DATA)
            if r in run.ended:
                failures.append(run.ended[r])
                continue
            exc = RolloutTimeout(f"NeMo-Gym prompt group exceeded {self.rf.nemo_gym.rollout_timeout_s}s")
            coords = Coords(run.step, run.group, r, run.row_attempt[r] - 1)
            if r in run.sending:
                url, sent_at = run.sending.pop(r)
                exc.agent_url = run.last_url[r] = url
                silent[url] = min(sent_at, silent.get(url, (sent_at, coords))[0]), coords
            failures.append((coords, exc))
        for url, (sent_at, coords) in silent.items():
            self._agent_failed(url, "timeout", sent_at, coords)
        return failures

    async def _row(self, run: GroupRun, r: int):
        """One row, re-sent alone on INFRA failures (row redispatch) and on an agent server's bad
        answer while another is up, each send to the agent server the pool picks (another than the
        one it last failed on, where one is up). Returns a Rollout or (coords, exc)."""
        out, url = run.out, run.last_url.get(r)
        max_sends = self.rf.nemo_gym.max_row_attempts if self.can_redispatch else 1
        for sends in range(1, max_sends + 1):
            coords = Coords(run.step, run.group, r, run.row_attempt[r])
            run.row_attempt[r] += 1
            out.row_sends += 1
            self._planned_faults(coords, difficulty(run.row))
            self._probe_due(run.step)
            url = self.pool.pick(avoid=url)
            try:
                rollout = await self._send(run, r, coords, url)
            except RolloutFailure as exc:  # only the taxonomy's failures: a bug in minirl propagates
                del run.sending[r]
                exc.agent_url = run.last_url[r] = url
                exc = self._identical(run, r, coords, exc)
                elsewhere = isinstance(exc, AgentBadAnswer) and self.pool.up_besides(url)
                if (classify(exc) == INFRA or elsewhere) and sends < max_sends:
                    out.row_retries += 1
                    self._failure_event(out, coords, classify(exc), exc, "retried", scope="row", group_attempt=run.gid)
                    continue
                run.ended[r] = (coords, exc)
                return coords, exc
            del run.sending[r]
            run.streaks.pop(r, None)
            out.rows_returned += 1
            # its guard's rejections (on_reject=end_episode ends the episode, the row returns), counted
            # as it returns: a group lost later (dropped, skipped, its row discarded) still counts them
            out.guard_rejections += sum(g.get("decision") == "reject" for g in rollout.evidence.get("guard", []))
            out.summaries_failed += rollout.evidence.get("summaries_failed", 0)  # its failed summaries, so too
            self._agent_events(rollout)
            out.rollouts[r] = rollout
            if run.weight is not None:
                run.row_weight[r] = run.weight
            return rollout

    async def _send(self, run: GroupRun, r: int, coords: Coords, url: str) -> Rollout:
        """One `/run` of row r to `url`, its result validated; the pool learns whether `url` answered."""
        body = run_body(self.cfg, run.row, coords, run.gid)
        run.sending[r] = (url, time.monotonic())  # _row clears it; a send the deadline cancels keeps it
        self.in_flight[coords.key] = run.sending[r][1]
        self.occupancy.enter()
        self.pool.acquire(url)
        self.agent_sends[url] += 1
        try:
            try:
                result = await self.post(self.session, url, body)
            except (AgentUnreachable, AgentBadAnswer) as exc:
                reason = "refused" if isinstance(exc, AgentUnreachable) else "bad_answer"
                self._agent_failed(url, reason, run.sending[r][1], coords)
                raise
            except RolloutFailure as exc:
                if getattr(exc, "status", None) is not None:  # an HTTP answer: the server is there
                    self._agent_answered(url, run.step)
                raise
            self._agent_answered(url, run.step)
            return parse_rollout(
                result, coords, vocab_size=self.vocab_size,
                max_len=self.cfg.policy.max_total_sequence_length,
                overlong_filtering=self.cfg.grpo.overlong_filtering,
                allow_rewrites=self.cfg.context_compaction.enabled, max_abs_reward=self.max_abs_reward,
            )
        finally:
            self.pool.release(url)
            self.in_flight.pop(coords.key, None)
            self.occupancy.leave()
            self.last_progress = time.monotonic()

    # -- the agent servers' marks -----------------------------------------------------------------
    def _agent_failed(self, url: str, reason: str, sent_at: float, coords: Coords) -> None:
        down = self.pool.failed(url, reason, sent_at)
        if down is not None:
            self.emit({"type": "agent_down", **coords.as_dict(), "agent": url, "reason": reason,
                       "retry_in_s": round(down.retry_at - down.since, 3), "agent_servers_up": self.pool.up_count()})

    def _agent_answered(self, url: str, step: int) -> None:
        down = self.pool.answered(url)
        if down is not None:
            self._agent_up(url, down, "run", step)

    def _agent_up(self, url: str, down, via: str, step: int) -> None:
        self.emit({"type": "agent_up", "step": step, "agent": url, "via": via, "reason": down.reason,
                   "down_s": round(self.pool.clock() - down.since, 3), "agent_servers_up": self.pool.up_count()})

    def _probe_due(self, step: int) -> None:
        """Start a probe of each down agent server whose wait is over (in the background: no send waits)."""
        for url in self.pool.due():
            task = asyncio.create_task(self._probe(url, step))
            self.probes.add(task)
            task.add_done_callback(self.probes.discard)

    async def _probe(self, url: str, step: int) -> None:
        """`GET /health` of a down agent server: any answer below 500 within PROBE_TIMEOUT_S brings it up."""
        ok = False
        try:
            async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                ok = resp.status < 500
        except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError):  # RuntimeError: the session closed
            pass
        finally:  # cancelled too: the mark waits again rather than stay taken
            down = self.pool.probed(url, ok)
        if down is not None:
            self._agent_up(url, down, "probe", step)

    def agent_stats(self) -> dict:
        """The agent servers up now and each one's `/run` sends since the last call (metrics.jsonl)."""
        sends, self.agent_sends = self.agent_sends, Counter()
        return {"agent_servers_up": self.pool.up_count(), "agent_sends": {u: sends[u] for u in self.pool.urls}}

    def _identical(self, run: GroupRun, r: int, coords: Coords, exc: RolloutFailure) -> RolloutFailure:
        """Count row r's identical answers in a row; at `max_identical_failures` its failure is
        deterministic (a `deterministic` event) and comes back as a DeterministicFailure."""
        n, answer = self.rf.max_identical_failures, identical_answer(exc)
        last, count = run.streaks.get(r, (None, 0))
        count = count + 1 if answer is not None and answer == last else 1
        run.streaks[r] = (answer, count)
        if answer is None or n == 0 or count < n:
            return exc
        run.out.deterministic_failures += 1
        self.emit({"type": "deterministic", **coords.as_dict(), "status": answer[0], "sends": count,
                   "agent": exc.agent_url, "error": answer[1][:ERROR_BODY_LIMIT]})
        det = DeterministicFailure(
            f"the same failure {count} times in a row (deterministic, not retried: "
            f"async_rl.rollout_failure.max_identical_failures={n}): {' '.join(answer[1].split())}",
            getattr(exc, "error_type", None))
        det.__cause__, det.agent_url = exc, exc.agent_url
        return det

    def _planned_faults(self, c: Coords, num_rooms: int | None) -> None:
        for kind in FAULT_KINDS:
            call = self.plan.call_of(kind, c, num_rooms)
            if call is not None:
                self.emit({"type": "fault", "kind": kind, **c.as_dict(), "call": call})

    def _agent_events(self, r: Rollout) -> None:
        ev, c = r.evidence, r.coords.as_dict()
        if ev.get("compactions"):
            self.emit({"type": "compaction", **c, "reason": self.cfg.agent.context_history.policy.type,
                       "decision": "compacted", "compactions": ev["compactions"],
                       "images_dropped": ev.get("images_dropped", 0),
                       "reasoning_dropped": ev.get("reasoning_dropped", 0)})
        for g in ev.get("guard", []):  # the agent's record may not overwrite the event's type or coordinates
            self.emit({"reason": "max_total_tokens", **g, "type": "guard", **c})
        for s in ev.get("summary", []):  # a summarizing compaction's requests, failures and its limit
            self.emit({**s, "type": "summary", **c})
