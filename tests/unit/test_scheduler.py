"""The worker's scheduler driven with fake step outputs: no model, no broker, no clock."""

from __future__ import annotations

import pytest

from tokenyard.engines.base import StepOutput
from tokenyard.messages import FinishReason, ModelLimits, Priority, SamplingParams
from tokenyard.worker.scheduler import (
    Job,
    LaneHunch,
    Occupancy,
    Running,
    Scheduler,
    preemptible_lanes,
    preemption_victims,
)

LIMITS = ModelLimits(max_model_len=1000, max_seqs=4, token_budget=1000)


def job(name: str, prompt: int = 10, max_tokens: int = 90, resumed: int = 0) -> Job[str]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Job(name, f"lease-{name}", list(range(1, prompt + 1)), params, 0.0, [7] * resumed)


def out(
    name: str,
    tokens: list[int],
    finish: FinishReason | None = None,
    error: str | None = None,
) -> StepOutput:
    text = "".join(f"<{t}>" for t in tokens)
    return StepOutput(name, tokens, text, finish, 10, len(tokens), error)


def names(jobs: list[Job[str]]) -> list[str]:
    return [j.job_id for j in jobs]


def test_an_idle_scheduler_claims_its_slots_plus_the_reserve() -> None:
    assert Scheduler[str](LIMITS, claim_ahead=2).want() == 6
    assert Scheduler[str](LIMITS).want() == 4


def test_starts_up_to_max_seqs_and_keeps_the_rest_waiting() -> None:
    s = Scheduler[str](LIMITS, claim_ahead=2)
    for i in range(6):
        s.offer(job(f"j{i}"))
    plan = s.schedule()
    assert names(plan.start) == ["j0", "j1", "j2", "j3"]
    assert (s.running, s.waiting, s.want()) == (4, 2, 0)
    assert not s.schedule()  # nothing changed, nothing to do


def test_a_finished_job_frees_its_slot_for_the_next_in_claim_order() -> None:
    s = Scheduler[str](LIMITS, claim_ahead=1)
    for i in range(5):
        s.offer(job(f"j{i}"))
    s.schedule()
    update = s.update([out("j1", [5, 6], FinishReason.STOP)])
    [(finished, reason, tail)] = update.finished
    assert (finished.job_id, reason) == ("j1", FinishReason.STOP)
    assert tail is not None and tail.token_ids == [5, 6] and finished.text == "<5><6>"
    assert names(s.schedule().start) == ["j4"]
    assert s.want() == 1  # the reserve refills


def test_the_token_budget_bounds_what_runs_in_strict_order() -> None:
    s = Scheduler[str](ModelLimits(max_model_len=1000, max_seqs=8, token_budget=500))
    s.offer(job("a", prompt=100, max_tokens=100))  # 200
    s.offer(job("b", prompt=100, max_tokens=150))  # 250
    s.offer(job("long", prompt=100, max_tokens=300))  # 400: does not fit beside a and b
    s.offer(job("short", prompt=5, max_tokens=5))  # fits, but must not overtake "long"
    assert names(s.schedule().start) == ["a", "b"]
    assert s.tokens_in_use == 450
    s.update([out("a", [1], FinishReason.LENGTH)])
    assert names(s.schedule().start) == []  # 250 + 400 > 500: long still waits at the head
    s.update([out("b", [1], FinishReason.LENGTH)])
    assert names(s.schedule().start) == ["long", "short"]


def test_claims_are_bounded_by_the_tokens_left() -> None:
    s = Scheduler[str](ModelLimits(max_model_len=1000, max_seqs=64, token_budget=1000))
    for i in range(2):
        s.offer(job(f"j{i}", prompt=100, max_tokens=100))
    s.schedule()
    # 600 tokens left at ~200 per job: 3 more could run, plus the default reserve of 0
    assert s.want() == 3


def test_requests_over_the_limits_are_refused_with_the_one_rule() -> None:
    s = Scheduler[str](ModelLimits(max_model_len=100, max_seqs=4, token_budget=1000))
    s.offer(job("too-long", prompt=60, max_tokens=50))
    s.offer(job("empty", prompt=0))
    s.offer(job("ok", prompt=10, max_tokens=20))
    plan = s.schedule()
    refused = {j.job_id: e for j, e in plan.refused}
    assert refused["too-long"].code == "context_length_exceeded"
    assert "maximum context length is 100" in refused["too-long"].message
    assert refused["empty"].message == "The prompt is empty"
    assert names(plan.start) == ["ok"]


def test_the_budget_is_a_limit_too_when_smaller_than_the_context() -> None:
    s = Scheduler[str](ModelLimits(max_model_len=4096, max_seqs=4, token_budget=256))
    s.offer(job("big", prompt=200, max_tokens=100))
    [(_, error)] = s.schedule().refused
    assert error.code == "context_length_exceeded" and "256" in error.message


def test_a_job_resumed_to_its_last_token_is_done_without_the_engine() -> None:
    s = Scheduler[str](LIMITS)
    s.offer(job("whole", max_tokens=5, resumed=5))
    s.offer(job("half", max_tokens=5, resumed=2))
    plan = s.schedule()
    assert names(plan.done) == ["whole"] and names(plan.start) == ["half"]


def test_each_step_is_one_event_per_job_also_when_steps_arrive_together() -> None:
    s = Scheduler[str](LIMITS)
    for name in ("a", "b"):
        s.offer(job(name))
    s.schedule()
    update = s.update([out("a", [1]), out("b", [2]), out("a", [3]), out("ghost", [9])])
    assert [(j.job_id, c.token_ids, c.text) for j, c in update.events] == [
        ("a", [1], "<1>"),
        ("b", [2], "<2>"),
        ("a", [3], "<3>"),
    ]
    assert update.tokens == 3 and not update.finished
    # nothing follows a finish: a stray output after it is ignored
    update = s.update([out("a", [4], FinishReason.STOP), out("a", [5])])
    assert [(j.job_id, t.token_ids if t else None) for j, _, t in update.finished] == [("a", [4])]
    assert s.get("a") is None and s.running == 1


def test_an_engine_error_fails_the_job_and_keeps_its_tokens() -> None:
    s = Scheduler[str](LIMITS)
    s.offer(job("bad"))
    s.schedule()
    update = s.update([out("bad", [1, 2], FinishReason.ERROR, "boom")])
    assert [(j.job_id, e) for j, e in update.failed] == [("bad", "boom")]
    assert [c.token_ids for _, c in update.events] == [[1, 2]]
    assert s.running == 0 and s.tokens_in_use == 0


def test_remove_and_take_waiting_free_what_they_held() -> None:
    s = Scheduler[str](LIMITS, claim_ahead=2)
    for i in range(6):
        s.offer(job(f"j{i}"))
    s.schedule()
    removed = s.remove("j0")
    assert removed is not None and removed.handle == "lease-j0"
    assert s.remove("j0") is None
    assert names(s.take_waiting()) == ["j4", "j5"]
    assert (s.running, s.waiting) == (3, 0)
    assert names(s.drain()) == ["j1", "j2", "j3"] and s.tokens_in_use == 0


def test_an_output_the_engine_refused_fails_without_a_retry() -> None:
    s = Scheduler[str](LIMITS)
    s.offer(job("rejected"))
    s.schedule()
    refusal = out("rejected", [], FinishReason.ERROR, "upstream said 400")
    refusal.refused = True
    update = s.update([refusal])
    assert [(j.job_id, e) for j, e in update.refused] == [("rejected", "upstream said 400")]
    assert not update.failed and s.running == 0


def test_waiting_jobs_start_by_priority_then_claim_order() -> None:
    s = Scheduler[str](LIMITS, claim_ahead=4)
    for i in range(4):
        s.offer(job(f"run{i}"))
    s.schedule()  # the engine is full
    for name, priority in [("b0", Priority.BATCH), ("n0", Priority.NORMAL), ("b1", Priority.BATCH)]:
        s.offer(Job(name, name, [1, 2], SamplingParams(max_tokens=4), 0.0, priority=priority))
    s.offer(Job("h0", "h0", [1, 2], SamplingParams(max_tokens=4), 0.0, priority=Priority.HIGH))
    s.offer(Job("n1", "n1", [1, 2], SamplingParams(max_tokens=4), 0.0))
    assert not s.schedule().start
    s.update([out(f"run{i}", [5], FinishReason.STOP) for i in range(4)])
    assert names(s.schedule().start) == ["h0", "n0", "n1", "b0"]


def test_batch_jobs_hold_at_most_their_share_of_the_slots() -> None:
    s = Scheduler[str](ModelLimits(max_model_len=1000, max_seqs=8, token_budget=8000), 2, 0.5)
    assert s.batch_room() == 4
    for i in range(3):
        s.offer(
            Job(
                f"b{i}", f"b{i}", [1, 2], SamplingParams(max_tokens=4), 0.0, priority=Priority.BATCH
            )
        )
    s.offer(job("n0"))
    s.schedule()
    assert s.batch_room() == 1  # interactive jobs do not count against it
    s.update([out("b0", [5], FinishReason.STOP)])
    assert s.batch_room() == 2
    assert Scheduler[str](LIMITS).batch_room() is None  # share 1.0: no cap
    assert (
        Scheduler[str](
            ModelLimits(max_model_len=99, max_seqs=1, token_budget=99), 0, 0.1
        ).batch_slots
        == 1
    )


EMBEDS = ModelLimits(
    max_model_len=8, max_seqs=4, token_budget=20, generates=False, embeds=True, vocab_size=100
)


def embed_job(name: str, lengths: list[int]) -> Job[str]:
    ids = [1] * sum(lengths)
    params = SamplingParams(max_tokens=0, temperature=0.0)
    return Job(name, f"lease-{name}", ids, params, 0.0, input_lengths=lengths)


def test_an_embeddings_job_runs_holds_its_tokens_and_carries_its_vectors() -> None:
    s = Scheduler[str](EMBEDS)
    s.offer(embed_job("e", [3, 5]))
    plan = s.schedule()
    assert names(plan.start) == ["e"] and not plan.done  # max_tokens 0 is not "already done"
    assert s.tokens_in_use == 8
    end = StepOutput("e", [], "", FinishReason.STOP, 8, 0, embeddings=[b"a", b"b"])
    [(finished, reason, tail)] = s.update([end]).finished
    assert (reason, tail, finished.embeddings) == (FinishReason.STOP, None, [b"a", b"b"])
    assert s.tokens_in_use == 0


def test_the_one_rule_refuses_embeddings_and_completions_by_what_the_model_runs() -> None:
    s = Scheduler[str](EMBEDS)
    s.offer(embed_job("long", [3, 9]))  # one input past the context
    s.offer(embed_job("many", [8, 8, 8]))  # all together past the budget
    s.offer(job("gen", prompt=2, max_tokens=2))  # this model does not generate
    refused = {j.job_id: e for j, e in s.schedule().refused}
    assert refused["long"].code == refused["many"].code == "context_length_exceeded"
    assert refused["gen"].code == "model_not_supported"
    gen = Scheduler[str](LIMITS)
    gen.offer(embed_job("e", [2]))
    [(_, error)] = gen.schedule().refused
    assert error.code == "model_not_supported" and error.param == "model"


def test_occupancy_integrates_the_running_count() -> None:
    held = Occupancy(since=10.0)
    assert held.level(2, 10.0) == 0.0  # two start at 10 s
    assert held.level(3, 11.0) == 2.0  # a third at 11 s
    assert held.level(0, 12.5) == 6.5  # all end at 12.5 s: 2·1 + 3·1.5
    assert held.level(0, 20.0) == 6.5  # idle time holds nothing
    assert held.level(1, 19.0) == 6.5  # a clock read out of order adds nothing


# -- preemption policy -----------------------------------------------------------------------
EVERY_LOWER = preemptible_lanes("normal,low,batch")


def test_victims_come_from_the_lowest_lane_first_latest_started_first() -> None:
    running = [
        Running("n", Priority.NORMAL, 1.0),
        Running("b-old", Priority.BATCH, 2.0),
        Running("b-new", Priority.BATCH, 3.0),
        Running("l", Priority.LOW, 4.0),
        Running("h", Priority.HIGH, 0.0),
    ]
    waiting = [Priority.HIGH] * 5
    assert preemption_victims(running, 0, waiting, EVERY_LOWER) == ["b-new", "b-old", "l", "n"]


def test_a_victim_is_strictly_below_the_job_it_makes_room_for() -> None:
    running = [Running("n", Priority.NORMAL, 1.0), Running("b", Priority.BATCH, 2.0)]
    # a normal job waiting preempts the batch job, never the other normal one
    assert preemption_victims(running, 0, [Priority.NORMAL] * 3, EVERY_LOWER) == ["b"]
    assert preemption_victims(running, 0, [Priority.BATCH], EVERY_LOWER) == []


def test_no_preemption_while_a_slot_is_free_or_for_lanes_not_preemptible() -> None:
    running = [Running("b", Priority.BATCH, 2.0), Running("n", Priority.NORMAL, 1.0)]
    assert preemption_victims(running, 1, [Priority.HIGH], EVERY_LOWER) == []
    assert preemption_victims(running, 0, [Priority.HIGH], preemptible_lanes("")) == []
    only_normal = preemptible_lanes("normal")
    assert preemption_victims(running, 0, [Priority.HIGH] * 2, only_normal) == ["n"]
    assert preemption_victims(running, 0, [Priority.HIGH], EVERY_LOWER, frozenset({"b"})) == ["n"]


def test_the_high_lane_is_never_preemptible() -> None:
    with pytest.raises(ValueError, match="never"):
        preemptible_lanes("high,batch")
    with pytest.raises(KeyError):
        preemptible_lanes("urgent")


def test_running_lanes_count_the_running_jobs_of_each_lane() -> None:
    s = Scheduler[str](LIMITS, claim_ahead=2)
    lanes = [Priority.BATCH, Priority.BATCH, Priority.NORMAL, Priority.HIGH, Priority.BATCH]
    for i, lane in enumerate(lanes):
        s.offer(Job(f"j{i}", f"j{i}", [1, 2], SamplingParams(max_tokens=4), 0.0, priority=lane))
    s.schedule()  # by lane, then claim order: j4 waits
    assert dict(s.running_lanes()) == {Priority.HIGH: 1, Priority.NORMAL: 1, Priority.BATCH: 2}
    s.update([out("j3", [5], FinishReason.STOP)])
    s.remove("j0")
    s.remove("j4")  # waiting: no running lane changes
    assert dict(s.running_lanes()) == {Priority.NORMAL: 1, Priority.BATCH: 1}
    s.schedule()
    assert dict(s.running_lanes()) == {Priority.NORMAL: 1, Priority.BATCH: 1}
    s.drain()
    assert dict(s.running_lanes()) == {}


def lane_job(name: str, priority: Priority) -> Job[str]:
    return Job(name, name, [1, 2], SamplingParams(max_tokens=4), 0.0, priority=priority)


def steps(s: Scheduler[str], n: int) -> None:
    """n engine steps of every running job, one delivery each."""
    for _ in range(n):
        s.update([out(job.job_id, [5]) for job in s.running_jobs()])


def test_a_job_outranking_every_running_one_takes_its_first_step_alone() -> None:
    s = Scheduler[str](LIMITS, claim_ahead=2, alone_every=8)
    s.offer(lane_job("b0", Priority.BATCH))
    assert s.schedule().alone == set()  # nothing runs beside it: its step is its own anyway
    steps(s, 8)
    s.offer(lane_job("h0", Priority.HIGH))
    s.offer(lane_job("b1", Priority.BATCH))
    plan = s.schedule()
    assert names(plan.start) == ["h0", "b1"]
    assert plan.alone == {"h0"}  # b1 outranks nothing; h0 outranks b0 (and b1)
    s.update([out("h0", [5], FinishReason.STOP)])
    steps(s, 8)
    s.offer(lane_job("n0", Priority.NORMAL))
    assert s.schedule().alone == {"n0"}  # any lane above every running one
    steps(s, 8)
    s.offer(lane_job("n1", Priority.NORMAL))  # only equal to n0, the highest running: no
    assert s.schedule().alone == set()


def test_a_high_job_refilling_an_emptied_engine_goes_before_the_batch_it_starts_with() -> None:
    s = Scheduler[str](LIMITS, claim_ahead=4, alone_every=8)
    for name in ("b0", "b1", "b2"):
        s.offer(lane_job(name, Priority.BATCH))
    s.offer(lane_job("h0", Priority.HIGH))
    plan = s.schedule()  # an empty engine: all start in one pass
    assert names(plan.start) == ["h0", "b0", "b1", "b2"]
    assert plan.alone == {"h0"}  # its first token need not wait on three prefills
    alone = Scheduler[str](LIMITS, alone_every=8)
    alone.offer(lane_job("h0", Priority.HIGH))
    alone.offer(lane_job("h1", Priority.HIGH))
    assert alone.schedule().alone == set()  # nothing lower beside them


def test_alone_steps_are_spaced_by_alone_every_engine_steps() -> None:
    s = Scheduler[str](ModelLimits(max_model_len=1000, max_seqs=8, token_budget=8000), 0, 1.0, 4)
    s.offer(lane_job("b0", Priority.BATCH))
    s.schedule()
    s.offer(lane_job("h0", Priority.HIGH))
    assert s.schedule().alone == {"h0"}  # the first one: nothing to space it from
    s.update([out("h0", [5], FinishReason.STOP)])  # its step alone: 1
    s.update([out("b0", [5])])  # 2
    s.offer(lane_job("h1", Priority.HIGH))
    assert s.schedule().alone == set()  # two steps after h0's: the batch waited too recently
    s.update([out("h1", [5], FinishReason.STOP), out("b0", [5])])  # 3
    s.offer(lane_job("h2", Priority.HIGH))
    assert s.schedule().alone == set()
    # two steps delivered together (the worker was busy): b0 and h2 twice each
    s.update([out("b0", [5]), out("h2", [5]), out("b0", [5]), out("h2", [5], FinishReason.STOP)])
    s.offer(lane_job("h3", Priority.HIGH))
    assert s.schedule().alone == {"h3"}  # 5 steps since h0's: the batch had its 4
    # off: never
    off = Scheduler[str](LIMITS, alone_every=0)
    off.offer(lane_job("b0", Priority.BATCH))
    off.schedule()
    off.offer(lane_job("h0", Priority.HIGH))
    assert off.schedule().alone == set()


def test_only_the_highest_lane_starting_goes_alone_and_shares_one_step() -> None:
    s = Scheduler[str](LIMITS, claim_ahead=2, alone_every=8)
    s.offer(lane_job("b0", Priority.BATCH))
    s.schedule()
    s.offer(lane_job("h0", Priority.HIGH))
    s.offer(lane_job("n0", Priority.NORMAL))
    s.offer(lane_job("h1", Priority.HIGH))
    plan = s.schedule()
    assert names(plan.start) == ["h0", "h1", "n0"]
    assert plan.alone == {"h0", "h1"}  # one step for the two; n0 joins the batch's


def claimed(name: str, priority: Priority, at: float) -> Job[str]:
    job = lane_job(name, priority)
    job.claimed_at = at
    return job


def test_a_step_prefill_cap_holds_while_a_higher_lane_had_a_job_within_the_window() -> None:
    s = Scheduler[str](LIMITS, claim_ahead=2, prefill_cap=64, prefill_cap_window_s=1.0)
    assert s.step_prefill_cap(100.0) is None  # nothing runs
    s.offer(claimed("b0", Priority.BATCH, 100.0))
    s.schedule()
    assert s.step_prefill_cap(100.0) is None  # batch work alone: no higher lane came
    s.offer(claimed("h0", Priority.HIGH, 101.0))
    s.schedule()
    assert s.step_prefill_cap(101.5) == 64  # b0 runs below a lane claimed 0.5 s ago
    s.update([out("h0", [5], FinishReason.STOP)])
    assert s.step_prefill_cap(101.9) == 64  # h0 ended; its lane may come again
    assert s.step_prefill_cap(102.1) is None  # the window has passed
    s.offer(claimed("n0", Priority.NORMAL, 103.0))
    s.schedule()
    assert s.step_prefill_cap(103.2) == 64  # any lane above one that runs
    s.update([out("b0", [5], FinishReason.STOP)])
    assert s.step_prefill_cap(103.2) is None  # n0 alone: nothing runs below its lane
    s.offer(claimed("n1", Priority.NORMAL, 103.1))  # an equal lane is no reason either
    s.schedule()
    assert s.step_prefill_cap(103.2) is None
    off = Scheduler[str](LIMITS, claim_ahead=2)  # prefill_cap 0: never
    off.offer(claimed("b0", Priority.BATCH, 100.0))
    off.offer(claimed("h0", Priority.HIGH, 100.0))
    off.schedule()
    assert off.step_prefill_cap(100.0) is None


def test_a_lane_hunch_no_claim_bore_out_backs_off_twice_as_long_each_time() -> None:
    hunch = LaneHunch(first_s=0.25, most_s=1.0)
    assert hunch.may_preempt(1, 0.0)
    hunch.preempted(Priority.HIGH, 1)
    assert not hunch.may_preempt(1, 0.01)  # the next claim has not answered
    hunch.claimed([Priority.NORMAL], 0.1)  # the freed slot went to normal work
    assert not hunch.may_preempt(1, 0.3)
    assert hunch.may_preempt(1, 0.35)
    hunch.preempted(Priority.HIGH, 1)
    hunch.claimed([], 0.4)  # an empty claim: nothing it could take either
    assert not hunch.may_preempt(1, 0.85) and hunch.may_preempt(1, 0.9)
    for t in (1.0, 2.0, 3.0):
        hunch.preempted(Priority.HIGH, 1)
        hunch.claimed([Priority.NORMAL], t)
    assert hunch.backoff_s == 1.0  # at most most_s


def test_a_lane_hunch_tries_again_for_more_work_and_forgets_its_doubt() -> None:
    hunch = LaneHunch()
    hunch.preempted(Priority.HIGH, 1)
    hunch.claimed([Priority.LOW], 0.0)
    assert not hunch.may_preempt(1, 0.1)
    assert hunch.may_preempt(2, 0.1)  # a job more than the doubted one: news
    hunch.preempted(Priority.HIGH, 2)
    hunch.claimed([Priority.NORMAL, Priority.HIGH], 0.2)  # borne out
    assert hunch.may_preempt(1, 0.2) and hunch.backoff_s == 0.0
    hunch.preempted(Priority.NORMAL, 1)
    hunch.claimed([Priority.LOW], 0.3)
    assert not hunch.may_preempt(0, 0.3)  # nothing waits: nothing to preempt for
    assert hunch.may_preempt(1, 0.3)  # and the doubt is gone with it
