"""The worker's one scheduler: a pure state machine, in the style of vLLM's and TGI's.

It owns the slot count and the token budget. Claimed jobs are *offered*; `schedule()` says
which start now, which are refused (and why) and which were already finished by an earlier
delivery, and which of those starting take their first engine step alone (they outrank every
running job: their first token is not held behind a full batch's step); `update()` turns
engine step outputs into token events, completions and failures and frees their capacity;
`want()` says how many more jobs to claim, keeping a small claimed-but-not-started reserve so
a freed slot never waits on a Redis round trip. The worker does all I/O; nothing here awaits,
sleeps or reads a clock.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tokenyard.engines.base import StepOutput, footprint
from tokenyard.errors import InvalidRequest
from tokenyard.limits import embedding_refusal, refusal
from tokenyard.messages import (
    FinishReason,
    ModelLimits,
    PoolingOptions,
    Priority,
    PromptLogprob,
    SamplingParams,
    TokenChunk,
    TokenLogprob,
)

H = TypeVar("H")  # the worker's handle on a job (its lease); opaque here


@dataclass(eq=False)
class Job(Generic[H]):
    """A claimed job as the scheduler sees it; `token_ids` include tokens resumed from a crash."""

    job_id: str
    handle: H
    prompt_ids: list[int]
    params: SamplingParams
    claimed_at: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token_at: float | None = None  # of this delivery, on the clock `update` is given
    added_at: float | None = None  # when the worker added it to the engine (its own clock)
    last_token_at: float | None = None
    priority: Priority = Priority.NORMAL  # its lane's: waiting jobs start by priority
    # an embeddings job: `prompt_ids` are its inputs one after another, of these lengths
    input_lengths: list[int] | None = None
    embeddings: list[bytes] | None = None  # its vectors, once the engine made them
    pooling: PoolingOptions | None = None  # an embeddings or scoring job's options
    logprobs: list[TokenLogprob] | None = None  # one per token id, when its params ask
    cached_tokens: int | None = None  # prompt tokens its engine's prefix cache held
    prompt_logprobs: list[PromptLogprob] | None = None  # when its params ask
    # tokens (and characters of text) an earlier delivery left in its events: a preemption of
    # a job nobody streams writes the rest there first, so the next holder resumes after them
    durable_tokens: int = 0
    durable_chars: int = 0

    def extend(
        self, token_ids: Sequence[int], text: str, logprobs: Sequence[TokenLogprob] | None
    ) -> None:
        """Append tokens to the output (a step's, or an earlier delivery's from its events)."""
        self.token_ids.extend(token_ids)
        self.text += text
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs)

    @property
    def decode_s(self) -> float | None:
        """First to last token of this delivery."""
        if self.first_token_at is None or self.last_token_at is None:
            return None
        return self.last_token_at - self.first_token_at

    @property
    def footprint(self) -> int:
        """Tokens the job reserves, counted as the engine's ledger counts them."""
        return footprint(len(self.prompt_ids), self.params)


@dataclass
class Plan(Generic[H]):
    """What to do after a scheduling pass."""

    start: list[Job[H]] = field(default_factory=list)  # add to the engine now, in this order
    refused: list[tuple[Job[H], InvalidRequest]] = field(default_factory=list)  # fail at once
    done: list[Job[H]] = field(default_factory=list)  # an earlier delivery already finished it
    # jobs of `start` whose first engine step runs alone (`EngineRequest.alone`): those of the
    # highest lane starting, above every job that ran before this pass (`Scheduler.schedule`)
    alone: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.start or self.refused or self.done)


@dataclass
class Update(Generic[H]):
    """What one or more engine steps mean for the jobs: publish, complete, retry."""

    events: list[tuple[Job[H], TokenChunk]] = field(default_factory=list)
    finished: list[tuple[Job[H], FinishReason, TokenChunk | None]] = field(default_factory=list)
    failed: list[tuple[Job[H], str]] = field(default_factory=list)  # engine faults: retry
    refused: list[tuple[Job[H], str]] = field(default_factory=list)  # the request's fault: fail
    tokens: int = 0


@dataclass
class Occupancy:
    """The time integral of the running count (slot-seconds held): jobs done over it is the
    mean time a job holds a slot, exactly, where sampling the count at heartbeats is not."""

    since: float
    running: int = 0
    total: float = 0.0

    def level(self, running: int, now: float) -> float:
        """The count is `running` from `now` on; the slot-seconds held up to `now`."""
        self.total += self.running * max(0.0, now - self.since)
        self.running, self.since = running, now
        return self.total


def moving_average(previous: float, sample: float, weight: float = 0.2) -> float:
    """Exponential moving average; the first sample seeds it."""
    return sample if previous <= 0 else previous + weight * (sample - previous)


class Scheduler(Generic[H]):
    """Decides what runs on one engine; see the module docstring for the protocol."""

    def __init__(
        self,
        limits: ModelLimits,
        claim_ahead: int = 0,
        batch_share: float = 1.0,
        alone_every: int = 0,
        prefill_cap: int = 0,
        prefill_cap_window_s: float = 1.0,
    ) -> None:
        if limits.max_seqs < 1 or limits.token_budget < 1 or limits.max_model_len < 2:
            raise ValueError(f"unusable limits {limits}")
        if not 0.0 < batch_share <= 1.0:
            raise ValueError(f"batch_share must be in (0, 1], not {batch_share}")
        if alone_every < 0:
            raise ValueError(f"alone_every must be >= 0, not {alone_every}")
        if prefill_cap < 0 or prefill_cap_window_s < 0:
            raise ValueError("prefill_cap and its window must be >= 0")
        self.limits = limits
        self.claim_ahead = max(0, claim_ahead)
        # A job that outranks every running one takes its first step alone (`Plan.alone`), at
        # most once per `alone_every` engine steps: each such step holds the running sequences
        # back one step, so however many urgent jobs come they keep at least
        # (alone_every - 1) / alone_every of the engine's steps. 0: never.
        self.alone_every = alone_every
        self._steps_since_alone = alone_every  # engine steps since the last one granted
        # While a lane above one that runs has had a job offered within the window, a step
        # prefills at most `prefill_cap` prompt tokens of the sequences not `alone`
        # (`step_prefill_cap`): a job of that lane arriving then waits for the step in flight,
        # and a step carrying a long prompt's whole prefill is as long as that prompt. 0: never.
        self.prefill_cap = prefill_cap
        self.prefill_cap_window_s = prefill_cap_window_s
        self._offered_at: dict[Priority, float] = {}  # each lane's latest offer (claimed_at)
        # Batch-lane jobs held at once; the rest of the slots stay for interactive work, which
        # cannot overtake a running sequence. At least one: the batch lane is never starved.
        self.batch_slots = (
            None if batch_share >= 1.0 else max(1, int(limits.max_seqs * batch_share))
        )
        self._waiting: deque[Job[H]] = deque()
        self._fresh: deque[Job[H]] = deque()  # offered, not yet checked against the rule
        self._running: dict[str, Job[H]] = {}
        # running jobs per lane: the preemption look-out asks it every few milliseconds, and
        # a scan of every running job each time cost the worker's loop more than its publishing
        self._lanes: Counter[Priority] = Counter()
        self._tokens_running = 0
        self._expected_footprint = 0.0

    # -- views -----------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting) + len(self._fresh)

    @property
    def tokens_in_use(self) -> int:
        """Tokens reserved by running jobs."""
        return self._tokens_running

    def jobs(self) -> Iterator[Job[H]]:
        """Every job held: running first, then waiting."""
        yield from self._running.values()
        yield from self._waiting
        yield from self._fresh

    def get(self, job_id: str) -> Job[H] | None:
        return self._running.get(job_id)

    def running_lanes(self) -> Mapping[Priority, int]:
        """How many jobs of each lane run (lanes with none may be left out)."""
        return self._lanes

    def running_jobs(self) -> list[Job[H]]:
        return list(self._running.values())

    def waiting_jobs(self) -> list[Job[H]]:
        """Claimed, not started (the reserve)."""
        return [*self._waiting, *self._fresh]

    # -- claiming --------------------------------------------------------------------------
    def want(self) -> int:
        """How many jobs to claim now: what could run at once, plus the reserve, minus held.

        Prompt lengths are unknown before the claim, so free tokens are divided by the mean
        footprint seen so far; an idle scheduler always asks for at least one job.
        """
        could_run = self.limits.max_seqs
        if self._expected_footprint > 0:
            spare = max(0, self.limits.token_budget - self._tokens_running)
            by_tokens = self.running + int(spare // self._expected_footprint)
            could_run = min(could_run, by_tokens)
        held = self.running + self.waiting
        want = could_run + self.claim_ahead - held
        return max(1 if held == 0 else 0, want)

    def batch_room(self) -> int | None:
        """How many batch-lane jobs the next claim may take (None: no cap)."""
        if self.batch_slots is None:
            return None
        held = self._lanes.get(Priority.BATCH, 0)
        held += sum(1 for job in self.waiting_jobs() if job.priority is Priority.BATCH)
        return max(0, self.batch_slots - held)

    def offer(self, job: Job[H]) -> None:
        """A claimed job joins the queue; the next `schedule()` starts, keeps or refuses it."""
        self._fresh.append(job)
        at = self._offered_at.get(job.priority)
        if at is None or job.claimed_at > at:
            self._offered_at[job.priority] = job.claimed_at

    def step_prefill_cap(self, now: float) -> int | None:
        """The most prompt tokens an engine step may prefill now (of sequences not `alone`), or
        None for the engine's own budget: capped while something runs below a lane that had a
        job offered within `prefill_cap_window_s` before `now` (the clock of `Job.claimed_at`),
        so the next job of that lane waits for a short step, not a long prompt's prefill."""
        if not self.prefill_cap or not self._lanes:
            return None
        lowest = max(self._lanes)
        recent = now - self.prefill_cap_window_s
        if any(lane < lowest and at >= recent for lane, at in self._offered_at.items()):
            return self.prefill_cap
        return None

    # -- scheduling ------------------------------------------------------------------------
    def schedule(self) -> Plan[H]:
        """Move what fits from waiting to running, strictly by priority, then claim order.

        The started jobs of the highest lane starting go in `plan.alone` (their first step runs
        without the others) when that lane is above every job running before this pass and
        something of a lower lane runs beside them after it (else the step would be theirs
        anyway), unless the last such step was granted fewer than `alone_every` engine steps
        ago (as `update` counted them).
        """
        plan: Plan[H] = Plan()
        # the lanes running before this pass (lower is higher); a pass that refills an emptied
        # engine may start a high job beside batch jobs, whose prefills it need not wait on
        lanes_before = set(self._lanes)
        while self._fresh:
            job = self._fresh.popleft()
            if job.input_lengths is not None:
                error = embedding_refusal(
                    job.input_lengths, self.limits, token_ids=job.prompt_ids, pooling=job.pooling
                )
            else:
                error = refusal(
                    len(job.prompt_ids), job.params, self.limits, token_ids=job.prompt_ids
                )
            if error is not None:
                plan.refused.append((job, error))
            elif job.input_lengths is None and len(job.token_ids) >= job.params.max_tokens:
                plan.done.append(job)
            else:
                self._expected_footprint = moving_average(self._expected_footprint, job.footprint)
                self._enqueue(job)
        # Strict order: a long job at the head is not overtaken forever by short ones. Every
        # accepted job fits an empty engine (the rule checked it against the whole budget).
        while self._waiting and len(self._running) < self.limits.max_seqs:
            head = self._waiting[0]
            if self._tokens_running + head.footprint > self.limits.token_budget:
                break
            self._waiting.popleft()
            self._running[head.job_id] = head
            self._lanes[head.priority] += 1
            self._tokens_running += head.footprint
            plan.start.append(head)
        if plan.start and self.alone_every and self._steps_since_alone >= self.alone_every:
            first = plan.start[0].priority  # the highest lane starting: `start` is in order
            lowest = max(self._lanes)  # the lowest lane in the engine after this pass
            if first < lowest and all(first < lane for lane in lanes_before):
                plan.alone = {job.job_id for job in plan.start if job.priority == first}
                self._steps_since_alone = 0
        return plan

    def _enqueue(self, job: Job[H]) -> None:
        # Behind every waiting job of its priority or higher: an interactive job claimed after
        # the claim-ahead reserve filled with batch work starts at the next free slot.
        at = len(self._waiting)
        while at > 0 and self._waiting[at - 1].priority > job.priority:
            at -= 1
        self._waiting.insert(at, job)

    def remove(self, job_id: str) -> Job[H] | None:
        """Forget a job (lease lost, released, failed to start); frees its capacity."""
        job = self._running.pop(job_id, None)
        if job is not None:
            self._tokens_running -= job.footprint
            self._lanes[job.priority] -= 1
            if not self._lanes[job.priority]:
                del self._lanes[job.priority]
            return job
        for queue in (self._waiting, self._fresh):
            for held in queue:
                if held.job_id == job_id:
                    queue.remove(held)
                    return held
        return None

    def take_waiting(self) -> list[Job[H]]:
        """Take out the jobs that have not started (a draining worker hands them back)."""
        waiting = [*self._waiting, *self._fresh]
        self._waiting.clear()
        self._fresh.clear()
        return waiting

    def drain(self) -> list[Job[H]]:
        """Take every job out (shutdown); returns them, running first."""
        every = list(self.jobs())
        self._running.clear()
        self._lanes.clear()
        self._waiting.clear()
        self._fresh.clear()
        self._tokens_running = 0
        return every

    # -- engine outputs --------------------------------------------------------------------
    def update(self, outputs: Sequence[StepOutput], now: float = 0.0) -> Update[H]:
        """Fold step outputs into jobs; finished and failed jobs leave the running set.

        Each step's new tokens for a job are one event, also when several steps arrive together
        (the worker was still publishing the last): readers see the steps as the engine made
        them, carried by one broker write. A finishing job's last step rides with its result.
        """
        update: Update[H] = Update()
        if self._steps_since_alone < self.alone_every:
            # the engine steps these outputs span, until the next alone step is due: a step has
            # one output per sequence it ran, so steps delivered together repeat a sequence
            times = Counter(out.seq_id for out in outputs)
            self._steps_since_alone += max(times.values(), default=0)
        for out in outputs:
            job = self._running.get(out.seq_id)
            if job is None:
                continue  # released, removed or already finished: nobody waits for it here
            chunk = None
            if out.prompt_logprobs is not None and job.prompt_logprobs is None:
                job.prompt_logprobs = out.prompt_logprobs
            if out.token_ids:
                if job.first_token_at is None:
                    job.first_token_at = now
                job.last_token_at = now
            if out.token_ids or out.text:
                job.extend(out.token_ids, out.text, out.logprobs)
                update.tokens += len(out.token_ids)
                chunk = TokenChunk(token_ids=out.token_ids, text=out.text, logprobs=out.logprobs)
            if out.cached_tokens is not None:
                job.cached_tokens = out.cached_tokens
            if out.finish_reason is None:
                if chunk is not None:
                    update.events.append((job, chunk))
                continue
            self.remove(out.seq_id)
            reason, error = out.finish_reason, out.error or "engine error"
            if reason is FinishReason.ERROR:
                if chunk is not None:  # keep what was produced: the retry resumes after it
                    update.events.append((job, chunk))
                (update.refused if out.refused else update.failed).append((job, error))
            else:
                job.embeddings = out.embeddings
                # the last tokens ride with the completion: one write instead of two
                update.finished.append((job, reason, chunk))
        return update


# -- preemption ------------------------------------------------------------------------------
def preemptible_lanes(setting: str) -> frozenset[Priority]:
    """`WorkerSettings.preempt_lanes` read: the lanes whose running jobs may be preempted.
    The high (interactive) lane never is: nothing outranks it, and a client watching its
    stream would see it pause."""
    lanes = set()
    for name in setting.split(","):
        if name.strip():
            lane = Priority[name.strip().upper()]
            if lane is Priority.HIGH:
                raise ValueError("preempt_lanes: the high lane is never preempted")
            lanes.add(lane)
    return frozenset(lanes)


@dataclass(frozen=True)
class Running:
    """A running sequence as the preemption policy sees it."""

    job_id: str
    priority: Priority
    started_at: float  # when this delivery was claimed, on the caller's clock


def preemption_victims(
    running: Sequence[Running],
    free_slots: int,
    waiting: Sequence[Priority],
    preemptible: frozenset[Priority],
    spared: frozenset[str] = frozenset(),
) -> list[str]:
    """Which running jobs to preempt for the higher-priority jobs that wait (pure).

    Only when no slot is free. Each waiting job (highest priority first) takes one victim of a
    strictly lower priority, from the lowest lane first (batch, then low, then normal) and,
    within a lane, the latest started (it has the least to resume). `spared`: jobs not to
    preempt (preempted their maximum number of times, or embeddings: one step, nothing to
    resume). Victims are at most the waiting jobs: a preemption frees exactly one slot for one
    of them, so a job that waits never causes more than one preemption of this worker's.
    """
    if free_slots > 0 or not waiting or not preemptible:
        return []
    candidates = sorted(
        (r for r in running if r.priority in preemptible and r.job_id not in spared),
        key=lambda r: (-r.priority, -r.started_at),
    )
    victims: list[str] = []
    for lane in sorted(waiting):
        if not candidates or candidates[0].priority <= lane:
            break  # the lowest left outranks or equals this one, and every later one
        victims.append(candidates.pop(0).job_id)
    return victims


@dataclass
class LaneHunch:
    """Whether the look-out may preempt for work the lanes report waiting (pure; time given).

    Such a preemption is a hunch: it frees a slot for the next claim, which may not bring
    that work (it waits in a size pool this worker does not serve, is held for another worker,
    or another worker took it first), so the slot goes to work no better than the victim's.
    A hunch the next claim does not bear out makes the look-out leave lane work alone for
    `first_s`, twice as long after each one after that (`most_s` at the most), unless more
    such work comes; a claim that brings it, or lanes with none, forget the doubt.
    """

    first_s: float = 0.25
    most_s: float = 8.0
    backoff_s: float = 0.0
    quiet_until: float = 0.0
    doubted: int = 0  # the lane jobs a fruitless hunch was for: more than these is news
    pending: Priority | None = None  # a hunch the next claim answers: the lane it was for
    pending_count: int = 0

    def may_preempt(self, above: int, now: float) -> bool:
        """`above`: lane jobs that outrank what may be preempted and waited past the grace."""
        if above == 0:
            self.backoff_s, self.doubted = 0.0, 0
            return False
        if self.pending is not None:
            return False  # the claim that follows the last one has not answered yet
        return above > self.doubted or now >= self.quiet_until

    def preempted(self, lane: Priority, above: int) -> None:
        self.pending, self.pending_count = lane, above

    def claimed(self, lanes: Sequence[Priority], now: float) -> None:
        """What a claim brought (nothing: an empty claim) answers the pending hunch."""
        if self.pending is None:
            return
        if any(lane <= self.pending for lane in lanes):
            self.backoff_s, self.doubted = 0.0, 0
        else:
            self.backoff_s = min(self.most_s, self.backoff_s * 2 or self.first_s)
            self.quiet_until = now + self.backoff_s
            self.doubted = self.pending_count
        self.pending = None
