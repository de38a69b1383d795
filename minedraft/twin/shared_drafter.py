"""N engine replicas sharing one drafter GPU (`minedraft drafter` serving several engines), on simulated time.

Each replica is the twin's own (`TwinReplica`: the engine's planner, drafter link, wait policy), with its own
clock; the replicas run side by side, the one furthest behind in simulated time stepping next, so their clocks stay
within a step of each other. Their draft jobs go to one `SharedDrafter`: it drafts in rounds, one batched draft loop
per round over every job in it (the service batches jobs of different engines queued together), costing the curves'
draft loop at the round's total batch (nearly flat in batch on a GPU: the point of sharing) and at the round's mean
context (capped by the drafter window when there is one), plus every job's catch-up at the price a drafter of its own
pays (`replica.job_catch_up_ms`: newcomers' prompts, bounded by the window when there is one). A job joins the round
that has not started yet when it arrives, else waits for the drafter to be free: the queueing when several
replicas' jobs overlap.

Lookahead replicas' jobs carry extra branches (a request's second and later likeliest outcomes). As the service
does (service.py), a round shared by several jobs drafts each request's first item only (protocol.required_items),
and a round that ran extra branches counts their share of its time (by drafted tokens) as optional: spare time the
pool's autoscaler leaves out.

Causality: replicas submit slightly out of simulated-time order (each steps a whole step at once). A round whose
reply a replica has already received is closed: a later-processed job never lengthens it, it queues behind it
instead (at worst later than the service would run it: the sharing's cost is not understated).

The layout holds N x TP target GPUs + 1 drafter GPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from minedraft.engine.drafter import protocol
from minedraft.engine.drafter.client import JobTicket
from minedraft.engine.settings import Mode
from minedraft.twin.costs import AcceptanceModel, StepCosts
from minedraft.twin.replica import ReplicaSettings, SimClock, SimDrafter, SimRequest, TwinReplica, job_catch_up_ms
from minedraft.twin.run import RunResult, Workload, mode_label


@dataclass
class _Round:
    start: float
    end: float
    k: int
    batch: int = 0
    context_tokens: float = 0.0  # summed over the round's requests
    catch_up_ms: float = 0.0  # summed over the round's jobs: newcomers' prompts (and priced accepted tokens)
    jobs: int = 0
    closed: bool = False  # a replica received a reply of it: it can no longer grow
    counted: bool = False  # in the measured statistics (not by id(): ids of dropped rounds are reused)
    # A lone job's extra branches (rows beyond each request's first item) and their share of its drafted tokens: run
    # while the round is its alone, dropped once another job joins.
    optional_rows: int = 0
    optional_context_tokens: float = 0.0
    optional_share: float = 0.0

    @property
    def shared(self) -> bool:
        return self.jobs > 1


@dataclass
class _SharedJob:
    round: _Round
    reply: protocol.DraftReply


@dataclass
class SharedDrafter:
    """The drafter GPU: rounds of batched draft loops over the jobs of every replica."""

    costs: StepCosts
    rounds: list[_Round] = field(default_factory=list)
    busy_seconds: float = 0.0
    # Of busy_seconds, the time lone jobs' extra branches took (apportioned by drafted tokens).
    optional_seconds: float = 0.0

    def _loop_seconds(self, round_: _Round) -> float:
        context = round_.context_tokens / round_.batch
        return (self.costs.draft_ms(round_.batch, context, round_.k) + round_.catch_up_ms) / 1000.0

    def join(self, now: float, batch: int, context_tokens: float, k: int, catch_up_ms: float = 0.0,
             required: int | None = None, required_context_tokens: float | None = None,
             optional_share: float = 0.0) -> _Round:
        """A job of `batch` items arriving at `now` (`required` of them each request's first, with
        `required_context_tokens` of the items' `context_tokens`; the rest, extra branches, make `optional_share` of
        its drafted tokens), carrying `catch_up_ms` of catch-up (tokens to take in
        before drafting): into the round not yet started, where it and the jobs already there draft their required
        items only, else a new one when the drafter is free, all its items drafted while it is alone. A round pays
        one batched draft loop and every job's catch-up."""
        required = batch if required is None else required
        required_context = context_tokens if required_context_tokens is None else required_context_tokens
        last = self.rounds[-1] if self.rounds else None
        if last is not None and not last.closed and last.start >= now and last.k >= k:
            before = last.end - last.start
            last.batch += required - last.optional_rows
            last.context_tokens += required_context - last.optional_context_tokens
            last.optional_rows, last.optional_context_tokens = 0, 0.0
            self.optional_seconds -= before * last.optional_share
            last.optional_share = 0.0
            last.jobs += 1
            last.catch_up_ms += catch_up_ms
            last.end = last.start + self._loop_seconds(last)
            self.busy_seconds += (last.end - last.start) - before
            return last
        start = max(now, last.end) if last is not None else now
        round_ = _Round(start, start, k, batch, context_tokens, catch_up_ms=catch_up_ms, jobs=1,
                        optional_rows=batch - required, optional_context_tokens=context_tokens - required_context,
                        optional_share=optional_share)
        round_.end = start + self._loop_seconds(round_)
        self.busy_seconds += round_.end - start
        self.optional_seconds += (round_.end - start) * optional_share
        self.rounds.append(round_)
        # Only the latest rounds can still grow or be waited on; keep the list short.
        if len(self.rounds) > 64:
            del self.rounds[:-64]
        return round_


class SharedDrafterClient(SimDrafter):
    """One replica's view of the shared drafter (the `DrafterClient` its DrafterLink talks to)."""

    def __init__(self, clock: SimClock, costs: StepCosts, drafter: SharedDrafter) -> None:
        super().__init__(clock, costs, colocated=False)
        self.shared = drafter
        self.shared_jobs: list[_SharedJob] = []

    def submit(self, items: list[protocol.DraftItem], want_logprobs: bool, top_f: int = 0) -> JobTicket | None:
        self._next_id += 1
        now = self.clock.now
        k = max(item.num_draft_tokens for item in items)
        required = protocol.required_items(items)
        context_tokens = float(sum(item.base_num_tokens + len(item.token_ids) for item in items))
        required_context = float(sum(item.base_num_tokens + len(item.token_ids) for item in required))
        optional_share = 1.0 - protocol.drafted_tokens(required) / protocol.drafted_tokens(items)
        round_ = self.shared.join(now, len(items), context_tokens, k,
                                  job_catch_up_ms(self.costs, items, k, colocated=False), len(required),
                                  required_context, optional_share)
        results = self.draft_results(items, top_f)
        reply = protocol.DraftReply(self._next_id, results, draft_seconds=round_.end - round_.start,
                                    idle_seconds=0.0)
        self.shared_jobs.append(_SharedJob(round_, reply))
        return JobTicket(self._next_id, frozenset(item.request_id for item in items), now)

    def receive(self, timeout_seconds: float) -> list[protocol.FromDrafter]:
        due = [job for job in self.shared_jobs if job.round.end <= self.clock.now]
        if not due and timeout_seconds > 0:
            target = self.clock.now + timeout_seconds
            if self.shared_jobs:
                target = min(target, min(job.round.end for job in self.shared_jobs))
            self.clock.now = target
            due = [job for job in self.shared_jobs if job.round.end <= self.clock.now]
        for job in due:
            job.round.closed = True
            self.shared_jobs.remove(job)
        return [self._drafted(job) for job in sorted(due, key=lambda j: j.round.end)]

    @staticmethod
    def _drafted(job: _SharedJob) -> protocol.DraftReply:
        """The reply as drafted: in a shared round, each request's first result only (its extra branches dropped)."""
        reply = job.reply
        if not job.round.shared:
            return reply
        return protocol.DraftReply(reply.job_id, protocol.required_items(reply.results),
                                   draft_seconds=job.round.end - job.round.start, idle_seconds=reply.idle_seconds)

    def shutdown(self) -> None:
        self.shared_jobs.clear()


@dataclass
class SharedResult:
    replicas: int
    concurrency: int  # per replica
    result: RunResult  # all replicas together; gpus = replicas x TP + 1
    drafter_utilisation: float  # busy share of the drafter GPU over the measured time
    mean_round_batch: float  # requests per draft loop on the shared drafter
    jobs_per_round: float
    # Of drafter_utilisation, the share lone lookahead jobs' extra branches took (what the pool autoscaler leaves
    # out).
    optional_utilisation: float = 0.0


def run_shared(costs: StepCosts, acceptance: AcceptanceModel, k: int, replicas: int, concurrency: int,
               workload: Workload | None = None, warmup_steps: int = 40, measure_steps: int = 200,
               seed: int = 0, mode: str = Mode.PSD.value, min_measure_tokens: int = 8000) -> SharedResult:
    """`replicas` replicas in `mode` (psd, sd or lookahead), each at a fixed `concurrency` (a finished request is
    replaced at once), drafting on one shared drafter GPU. Measured per replica over at least `measure_steps` steps
    after `warmup_steps`, and `min_measure_tokens` output tokens in all; tokens/s is the replicas' sum."""
    if replicas < 1 or concurrency < 1:
        raise ValueError(f"replicas and concurrency must be >= 1, got {replicas} and {concurrency}")
    if mode not in (Mode.PSD.value, Mode.SD.value, Mode.LOOKAHEAD.value):
        raise ValueError(f"mode: a shared drafter serves sd, psd or lookahead replicas, got {mode!r}")
    workload = workload or Workload()
    drafter = SharedDrafter(costs)
    rng = random.Random(seed + 1)
    members: list[TwinReplica] = []
    counter = 0

    def new_request(at_s: float) -> SimRequest:
        nonlocal counter
        counter += 1
        return SimRequest(f"r{counter}", workload.prompt_tokens, workload.draw_output(rng), at_s)

    for index in range(replicas):
        settings = ReplicaSettings(mode=mode, k=k, seed=seed + 100 * index, max_num_seqs=concurrency)
        replica = TwinReplica(costs, acceptance, settings,
                              drafter=lambda clock: SharedDrafterClient(clock, costs, drafter))
        for _ in range(concurrency):
            request = new_request(0.0)  # already under way, at a random point of its output (a steady state)
            request.prefilled = True
            request.output_tokens = rng.randint(1, request.max_output_tokens - 1)
            replica.add(request)
        members.append(replica)

    steps = [0] * replicas
    tokens = [0] * replicas
    measure_from = [0.0] * replicas
    busy_from = optional_from = rounds_from = time_from = 0.0
    batch_total = jobs_total = 0
    started_measuring = False
    while min(steps) < warmup_steps + measure_steps or sum(tokens) < min_measure_tokens:
        index = min(range(replicas), key=lambda i: members[i].clock.now)
        replica = members[index]
        if steps[index] == warmup_steps:
            measure_from[index] = replica.clock.now
        if not started_measuring and min(steps) >= warmup_steps:
            started_measuring = True
            busy_from = drafter.busy_seconds
            optional_from = drafter.optional_seconds
            time_from = min(m.clock.now for m in members)
        outcome = replica.step()
        if steps[index] >= warmup_steps:
            tokens[index] += outcome.output_tokens
        steps[index] += 1
        for _ in outcome.finished:
            replica.add(new_request(replica.clock.now))
        if started_measuring:
            for round_ in drafter.rounds:
                if round_.closed and not round_.counted:
                    round_.counted = True
                    batch_total += round_.batch
                    jobs_total += round_.jobs
                    rounds_from += 1
    seconds = [members[i].clock.now - measure_from[i] for i in range(replicas)]
    tokens_per_s = sum(t / s for t, s in zip(tokens, seconds, strict=True) if s > 0)
    elapsed = max(m.clock.now for m in members) - time_from
    gpus = replicas * costs.hardware.tensor_parallel_size + 1
    # RunResult's tokens / seconds give the summed rate over one second of the common (mean) measured time.
    mean_seconds = sum(seconds) / replicas
    result = RunResult(f"shared-{mode_label(mode, k)}", k, gpus, round(tokens_per_s * mean_seconds), mean_seconds)
    result.deadline_misses = sum(m.deadline_misses for m in members)
    return SharedResult(
        replicas, concurrency, result,
        drafter_utilisation=min(1.0, (drafter.busy_seconds - busy_from) / elapsed) if elapsed > 0 else 0.0,
        optional_utilisation=min(1.0, (drafter.optional_seconds - optional_from) / elapsed) if elapsed > 0 else 0.0,
        mean_round_batch=batch_total / rounds_from if rounds_from else 0.0,
        jobs_per_round=jobs_total / rounds_from if rounds_from else 0.0,
    )
