"""The simulator's parts, each on its own, and the engine they make.

Hand-computed with the paper's analytic cost:
T(n, c) = 0.35 + 1[n>0] (0.90 + 0.055 n) + 1[c>0] (0.40 + 0.006 c) ms.
"""

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from sloweave.core.admission import (
    DECODE_SATURATED,
    EXCEEDS_KV_CAPACITY,
    TTFT_EXPIRED,
    TTFT_UNREACHABLE,
    AdmissionControl,
)
from sloweave.core.costs.calibrated import CalibratedCost, ContextFreeCost, OnlineCalibrator
from sloweave.core.costs.context_analytic import ContextAnalyticCost
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.policy import Aging, SLOWeave, decide_step, make_policy
from sloweave.core.size_grid import SizeGrid
from sloweave.core.slo import SLOException
from sloweave.sim.arrivals import AdmissionGate, AdmitAll, Arrivals
from sloweave.sim.batch import DecodeBatch
from sloweave.sim.clock import IterationClock
from sloweave.sim.deadline_source import CumulativeTargets, PerRequestTargets, SharedTarget, TrackedDeadlines
from sloweave.sim.decide import StepDecider, chunk_decider
from sloweave.sim.engine import build_engine, simulate
from sloweave.sim.workloads import get_workload_spec
from sloweave.sim.memory import KVCapacity, KVLedger, UnlimitedKV
from sloweave.sim.queue import FcfsPrompts, OnePrompt, PrefillQueue
from sloweave.sim.recorder import Recorder
from sloweave.sim.requests import NOT_STARTED, Requests
from sloweave.sim.workloads import WORKLOADS, Workload

T = AnalyticCost()
GOLDEN = Path(__file__).parent / "golden"


def requests(prompt, output=None, arrival_ms=None, tpot_ms=None) -> Requests:
    n = len(prompt)
    return Requests(list(arrival_ms or [0.0] * n), list(prompt), list(output or [3] * n), tpot_ms)


def workload(arrival_s, prompt, output, tpot_ms=None) -> Workload:
    return Workload("hand", np.asarray(arrival_s, float), np.asarray(prompt), np.asarray(output), tpot_ms=tpot_ms)


class FakeEngine(SimpleNamespace):
    """Just the attributes a part reads; what the queue hands on is recorded."""

    def prefill_completed(self, request):
        self.completed.append(request)


# ----------------------------------------------------------------------------- the queue and packing


def test_queue_takes_a_chunk_fcfs_across_prompts_and_hands_on_completed_ones():
    r = requests([100, 50, 80])
    queue = PrefillQueue(r)
    for i in range(3):
        queue.append(i)
    assert queue.queued_tokens == 230
    engine = FakeEngine(requests=r, recorder=Recorder(), iteration=7, end_ms=12.5, kv=KVLedger(), completed=[])
    queue.take(170, engine)
    assert engine.completed == [0, 1]  # 100 + 50 complete, 20 of the third
    assert list(queue.waiting) == [2] and r.remaining_prompt[2] == 60 and queue.queued_tokens == 60
    assert engine.recorder.piece_request == [0, 1, 2] and engine.recorder.piece_tokens == [100, 50, 20]
    assert engine.kv.reserved_kv == 230  # each prompt's KV is held from its first piece (released by the engine)
    assert r.progress_ms[2] == 12.5 and r.started(2)


def test_a_preempted_request_goes_back_behind_a_started_head_only():
    r = requests([100, 50, 80])
    queue = PrefillQueue(r)
    queue.append(0)
    queue.put_back(2)
    assert list(queue.waiting) == [2, 0]  # nothing started: it goes first
    r.remaining_prompt[2] = 30  # the head's prefill is under way
    queue.put_back(1)
    assert list(queue.waiting) == [2, 1, 0]
    assert queue.head_prefix_tokens() == 50


def test_one_prompt_offers_only_the_head_and_respects_slots_and_kv():
    r = requests([100, 50])
    queue = PrefillQueue(r)
    queue.append(0)
    queue.append(1)
    packing = OnePrompt(queue)
    assert packing.prompt_tokens(0, math.inf, math.inf) == 100
    assert packing.prompt_tokens(4, 0, math.inf) == 0  # no free batch slot for a new prompt
    assert packing.prompt_tokens(4, 1, 99) == 0  # its KV does not fit
    r.remaining_prompt[0] = 40  # started: admitted already, needs neither slot nor KV
    assert packing.prompt_tokens(4, 0, 0) == 40


def test_fcfs_packing_adds_prompts_until_the_policy_limit_slots_or_kv():
    r = requests([100, 50, 80, 10])
    queue = PrefillQueue(r)
    for i in range(4):
        queue.append(i)
    packing = FcfsPrompts(queue, lambda n: 200 - n)
    assert packing.prompt_tokens(0, math.inf, math.inf) == 230  # 100, 150 < 200, then 230 >= 200 stops
    assert packing.prompt_tokens(0, 2, math.inf) == 150  # two slots
    assert packing.prompt_tokens(0, math.inf, 140) == 100  # KV for the head only (100 + 50 > 140)


# ----------------------------------------------------------------------------- the decode batch and KV memory


def test_decode_batch_start_finish_and_preempt():
    r = requests([10, 10, 10], output=[1, 3, 5])
    batch = DecodeBatch(r)
    assert batch.start(0, 4) is None and batch.finished == 1 and r.finish_iter[0] == 4  # one token: done at once
    assert batch.start(1, 4) == 6 and batch.start(2, 5) == 9 and batch.n == 2
    assert batch.finish_due(5) == () and list(batch.finish_due(6)) == [1]
    victim, held = batch.preempt_newest(7)  # request 2 emitted in iterations 5, 6
    assert (victim, held) == (2, 12) and r.emitted_before[2] == 2 and r.closed_segments[2] == [(5, 6)]
    assert r.prefill_total[2] == r.remaining_prompt[2] == 12 and r.segment_first[2] == NOT_STARTED
    assert list(batch.finish_due(9)) == []  # its old last iteration no longer counts
    assert batch.start(2, 20) == 22  # three tokens left


def test_kv_capacity_refuses_what_never_fits_and_preempts_the_newest_until_decodes_fit():
    memory = KVCapacity(100)
    assert memory.refusal(60, 41) == EXCEEDS_KV_CAPACITY and memory.refusal(60, 40) == ""
    assert UnlimitedKV().refusal(10**9, 1) == "" and UnlimitedKV().free_tokens(KVLedger(), 5) == math.inf
    r = requests([40, 40], output=[50, 50])
    batch, ledger, queue = DecodeBatch(r), KVLedger(), PrefillQueue(r)
    for request in (0, 1):
        batch.start(request, 0)
        ledger.decode_kv += 40 + 1  # its prompt and first token (what the engine adds when a prefill completes)
    ledger.decode_kv += 2 * 20  # 20 more iterations of decodes
    assert ledger.decode_kv == 122 and memory.free_tokens(ledger, 2) == 100 - 122 - 3
    left = []
    engine = SimpleNamespace(
        kv=ledger,
        batch=batch,
        requests=r,
        iteration=20,
        now_ms=30.0,
        queue=queue,
        deadlines=SimpleNamespace(left=left.append),
    )
    memory.make_room(engine)
    assert left == [1] and list(queue.waiting) == [1] and batch.n == 1  # the newest went back to the queue
    assert memory.preemptions == 1 and memory.recompute_tokens == 60 and ledger.decode_kv == 62
    assert r.progress_ms[1] == 30.0 and queue.queued_tokens == 60


# ----------------------------------------------------------------------------- deadline sources


def test_shared_and_per_request_targets():
    assert SharedTarget(25.0).budget_ms(100.0, 3, {0: 9}) == 25.0
    source = PerRequestTargets(25.0, [10.0, 50.0, 30.0])
    running = {}
    for request, last in ((0, 5), (1, 9), (2, 7)):
        running[request] = last
        source.started(request, 1.0, 0, last)
    assert source.budget_ms(2.0, 1, running) == 10.0
    del running[0]  # finished: its heap entry dies lazily
    assert source.budget_ms(2.0, 6, running) == 30.0
    assert source.next_fresh_budget_ms(30.0, head=0) == 10.0 and source.next_fresh_budget_ms(30.0, None) == 30.0
    assert source.late(2, 0.0, 0, 30.0 + 1e-6) and not source.late(2, 0.0, 0, 30.0)


def test_cumulative_targets_bank_the_slack_of_a_request_running_ahead():
    source = CumulativeTargets(10.0, None)
    running = {0: 100}
    source.started(0, end_ms=5.0, iteration=0, last_iter=100)  # token k due at 5 + 10 k
    # three iterations of 2 ms: at iteration 3 (t = 11 ms) token 3 is due at 35 ms
    assert source.budget_ms(11.0, 3, running) == pytest.approx(24.0)
    assert source.late(0, 11.0, 3, 24.1) and not source.late(0, 11.0, 3, 23.9)
    assert source.banked and not SharedTarget(10.0).banked


def test_cumulative_per_request_targets_give_the_next_budget_before_any_request_started():
    # with per-request targets the lookahead's next budget was min() of the targets seen so far,
    # an empty sequence until a request started: every such run raised ValueError at its first step
    source = CumulativeTargets(25.0, [40.0, 8.0, 30.0])
    assert source.next_fresh_budget_ms(math.inf, None) == math.inf  # nobody decodes, no head: no deadline
    assert source.next_fresh_budget_ms(math.inf, 1) == 8.0  # the head joins with its own target
    source.started(2, end_ms=5.0, iteration=0, last_iter=10)
    assert source.next_fresh_budget_ms(12.0, None) == 30.0 and source.next_fresh_budget_ms(12.0, 1) == 8.0


def test_lookahead_runs_with_cumulative_deadlines_and_per_request_targets():
    workload = get_workload_spec("chat").generate(60, seed=0)
    tiers = dataclasses.replace(workload, tpot_ms=np.where(np.arange(len(workload)) % 2, 10.0, 50.0))
    result = simulate(tiers, make_policy("sloweave+lookahead"), tpot_ms=25.0, deadline_form="cumulative")
    assert result.finished.all()


def test_tracked_deadlines_check_the_source_against_the_core_tracker():
    source = TrackedDeadlines(SharedTarget(25.0))
    running = {0: 10}
    source.started(0, 4.0, 0, 10)
    source.emitted(running, 6.0)
    assert source.budget_ms(6.0, 1, running) == 25.0  # the tracker agrees: 6 + 25 - 6
    with pytest.raises(AssertionError, match="tracker budget"):
        source.budget_ms(7.0, 2, running)  # the source assumes everyone emitted at `now`; the tracker knows better
    with pytest.raises(ValueError, match="per-token"):
        TrackedDeadlines(CumulativeTargets(25.0, None))


# ----------------------------------------------------------------------------- arrivals and admission


def admission_engine(r, n_running=0):
    queue = PrefillQueue(r)
    engine = SimpleNamespace(
        requests=r,
        queue=queue,
        batch=SimpleNamespace(n=n_running),
        now_ms=0.0,
        memory=UnlimitedKV(),
        deadlines=SharedTarget(10.0),
    )
    return engine


def test_arrivals_queue_what_arrived_and_admit_all_rejects_only_what_never_fits():
    r = requests([10, 20, 30], arrival_ms=[0.0, 5.0, 9.0])
    engine = admission_engine(r)
    engine.memory = KVCapacity(25)
    engine.arrivals = arrivals = Arrivals(r.arrival_ms, AdmitAll())
    engine.now_ms = 5.0
    arrivals.admit(engine)
    assert list(engine.queue.waiting) == [0, 1] and arrivals.next_arrival_ms() == 9.0
    engine.now_ms = 9.0
    arrivals.admit(engine)
    assert r.rejected_reason[2] == EXCEEDS_KV_CAPACITY and arrivals.rejected == 1 and arrivals.next_arrival_ms() is None


def test_admission_gate_refuses_for_decode_pressure_and_ttft_and_defers_to_a_best_effort_lane():
    policy = SLOWeave()
    r = requests([100, 100, 4000], output=[5, 5, 5], arrival_ms=[0.0, 0.0, 0.0])
    engine = admission_engine(r, n_running=140)  # T(141, 0) = 9.005 > 0.9 x 10 ms
    gate = AdmissionGate(AdmissionControl("defer"), policy, policy.predicted_ms, [1000.0, 1000.0, 1.0])
    engine.arrivals = Arrivals(r.arrival_ms, gate)
    assert gate.refusal(engine, 0) == DECODE_SATURATED
    engine.batch.n = 0
    assert gate.refusal(engine, 0) == "" and gate.refusal(engine, 2) == TTFT_UNREACHABLE
    gate.refuse(engine, 2, TTFT_UNREACHABLE)
    assert list(gate.deferred) == [2] and r.deferred_reason[2] == TTFT_UNREACHABLE
    gate.before_iteration(engine)  # nothing waits: the deferred one is served
    assert list(engine.queue.waiting) == [2] and not gate.deferred
    # a waiting prompt past its TTFT target is dropped at the head (not a deferred one)
    engine.queue.waiting.clear()
    engine.queue.append(0)
    engine.now_ms = 1000.5
    reject_gate = AdmissionGate(AdmissionControl("reject"), policy, policy.predicted_ms, [1000.0, 1000.0, 1.0])
    engine.arrivals = Arrivals(r.arrival_ms, reject_gate)
    reject_gate.before_iteration(engine)
    assert r.rejected_reason[0] == TTFT_EXPIRED and not engine.queue and engine.arrivals.rejected == 1


# ----------------------------------------------------------------------------- the clock and the decision


def test_clock_hands_the_context_to_each_model_once_and_times_the_iteration():
    cost = ContextAnalyticCost()
    clock = IterationClock(cost, policy_cost=cost)
    clock.set_context(5000, 300)
    assert (cost.decode_kv_tokens, cost.prefill_prefix_tokens) == (5000, 300)
    assert clock.iteration_ms(4, 100) == cost.predict(4, 100, 5000, 300)
    assert not IterationClock(T, policy_cost=T).reads_context


def test_clock_feeds_online_correction_with_the_base_prediction():
    calibrator = OnlineCalibrator(alpha=1.0)
    corrected = CalibratedCost(ContextFreeCost(T), calibrator)
    clock = IterationClock(lambda n, c: 2.0 * T(n, c), policy_cost=corrected, correction=calibrator)
    assert clock.iteration_ms(4, 100) == 2.0 * T(4, 100)
    assert corrected(4, 100) == pytest.approx(2.0 * T(4, 100))  # learned from one step (alpha 1)
    with pytest.raises(ValueError, match="CalibratedCost"):
        IterationClock(T, policy_cost=T, correction=calibrator)


def test_plain_decision_is_the_policy_and_aging_records_a_core_slo_exception():
    policy = SLOWeave()
    assert chunk_decider(policy, None, policy.predicted_ms) == policy.decide
    decider = chunk_decider(policy, Aging(50.0, 64), policy.predicted_ms)
    assert isinstance(decider, StepDecider)
    r = requests([200], arrival_ms=[0.0])
    queue = PrefillQueue(r)
    queue.append(0)
    engine = SimpleNamespace(
        queue=queue,
        requests=r,
        now_ms=60.0,
        iteration=9,
        batch=SimpleNamespace(n=1, running={5: 99}),
        deadlines=SharedTarget(1.5),
    )
    decider.attach(engine)
    assert decider(1, 200, 1.5) == (64, False)  # decode-only fits (1.305 ms), no chunk does: aged after 60 ms
    (exception,) = decider.exceptions
    assert isinstance(exception, SLOException)
    assert (exception.iteration, exception.request, exception.chunk_tokens, exception.affected) == (9, 0, 64, (5,))
    assert exception.start_ms == 60.0 and exception.predicted_ms == T(1, 64)


# ----------------------------------------------------------------------------- the engine


def test_stepping_the_engine_by_hand_gives_the_run():
    wl = WORKLOADS["mixed"].generate(60, seed=2)
    engine = build_engine(wl, make_policy("sloweave"), 25.0)
    steps = 0
    while engine.batch.finished + engine.arrivals.rejected < len(wl) and engine.step():
        steps += 1
    stepped = engine.result()
    whole = simulate(wl, make_policy("sloweave"), 25.0)
    assert np.array_equal(stepped.iter_end_ms, whole.iter_end_ms) and stepped.finished.all()
    assert steps >= stepped.num_iterations  # plus the idle jumps to the next arrival


@pytest.mark.parametrize(
    "policy_name",
    ["sloweave", "sloweave-multi", "sloweave+lookahead", "fixed-256", "budget-1024", "sarathi-512", "full", "orca"],
)
def test_every_option_works_with_every_policy_and_accounts_for_every_request(policy_name):
    wl = WORKLOADS["mixed"].generate(150, seed=4)
    cost = ContextAnalyticCost()
    policy = make_policy(policy_name, cost=cost)
    result = simulate(
        wl,
        policy,
        10.0,
        actual_cost=cost,
        max_batch_size=24,
        aging=Aging(100.0),
        admission=AdmissionControl("defer"),
        ttft_ms=2000.0,
        kv_capacity_tokens=40000,
        deadline_form="cumulative",
    )
    status = result.status()
    assert set(status) <= {"finished", "rejected"} and (status == "finished").sum() > 0
    assert np.all(result.iter_decodes + np.bincount(result.prefill_iter, minlength=result.num_iterations) <= 24)
    finished = np.flatnonzero(status == "finished")
    assert all(result.token_iterations(i).size == wl.output_tokens[i] for i in finished)


def test_online_correction_learns_a_mispredicted_cost_and_stops_the_overruns():
    wl = WORKLOADS["long"].generate(300, seed=0)  # prompts always wait: chunks fill the budget
    actual = lambda n, c: 1.6 * T(n, c)  # the machine is 60 % slower than the model says

    def overrun_share(result):
        decided = np.isfinite(result.iter_budget_ms) & (result.iter_chunk_tokens > 0)
        took = result.iter_end_ms - result.iter_start_ms
        return float(np.mean(took[decided] > result.iter_budget_ms[decided] + 1e-9))

    plain = simulate(wl, SLOWeave(cost=T), 25.0, actual_cost=actual)
    calibrator = OnlineCalibrator()
    corrected = simulate(
        wl,
        SLOWeave(cost=CalibratedCost(ContextFreeCost(T), calibrator)),
        25.0,
        actual_cost=actual,
        correction=calibrator,
    )
    assert overrun_share(plain) > 0.5
    assert overrun_share(corrected) < 0.01
    assert calibrator.factor(8, True) == pytest.approx(1.6) and calibrator.factor(40, False) == pytest.approx(1.6)


def golden_cases():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sim_cases", GOLDEN / "sim_cases.py")
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    return cases, json.loads((GOLDEN / "simulator.json").read_text())


def test_results_are_bit_for_bit_those_of_the_simulator_before_it_was_split():
    cases, expected = golden_cases()
    got = cases.all_digests()
    assert got.keys() == expected.keys()
    assert [k for k in expected if got[k] != expected[k]] == []


def test_every_golden_case_pins_a_result_of_its_own():
    """A digest shared by two cases pins nothing about what tells them apart (the option, the
    policy): no two cases share one, unless sim_cases.py says why."""
    cases, expected = golden_cases()
    by_digest = {}
    for key, value in expected.items():
        by_digest.setdefault(value, []).append(key)
    shared = [frozenset(keys) for keys in by_digest.values() if len(keys) > 1]
    assert [sorted(keys) for keys in shared if keys not in cases.SAME_DIGEST_BY_DESIGN] == []
    # the two pairs that used to coincide everywhere: lookahead or not, reject or defer
    for w in cases.WORKLOAD_NAMES:
        for option in cases.LOOKAHEAD_OPTIONS:
            for base in ("sloweave", "sloweave-multi"):
                assert expected[f"{w}/{base}+lookahead/{option}"] != expected[f"{w}/{base}/{option}"]
        for p in cases.POLICIES:
            assert expected[f"{w}/{p}/4"] != expected[f"{w}/{p}/5"]


@pytest.mark.parametrize("action", ["reject", "defer"])
def test_the_admission_cases_refuse_requests_for_every_policy(action):
    """Options 4 and 5 pin admission control only where it refuses someone."""
    cases, _ = golden_cases()
    option = 4 if action == "reject" else 5
    for w in cases.WORKLOAD_NAMES:
        for p in cases.POLICIES:
            work, policy, tpot, kw = cases.case(w, p, option)
            assert kw["admission"].action == action
            result = simulate(work, policy, tpot, **kw)
            reasons = result.rejected_reason if action == "reject" else result.deferred_reason
            assert (reasons != "").sum() > 0, (w, p)


class ContextSpy(ContextAnalyticCost):
    """A context-aware cost that checks, at every decision, the context the engine hands it
    against a brute-force walk of the running requests and the queue."""

    engine = None
    checks = 0

    def set_context(self, decode_kv_tokens, prefill_prefix_tokens):
        engine = self.engine
        if engine is not None:
            r, it = engine.requests, engine.iteration
            walked = sum(r.prefill_total[q] + it - r.segment_first[q] for q in engine.batch.running)
            assert decode_kv_tokens == walked, (it, decode_kv_tokens, walked)
            waiting = engine.queue.waiting
            if prefill_prefix_tokens:
                assert prefill_prefix_tokens == r.prefill_total[waiting[0]] - r.remaining_prompt[waiting[0]]
            ContextSpy.checks += 1
        super().set_context(decode_kv_tokens, prefill_prefix_tokens)


@pytest.mark.parametrize("policy_name", ["sloweave", "sloweave-multi", "sarathi-512", "fixed-256"])
def test_the_context_handed_to_the_cost_is_what_a_walk_of_the_running_requests_gives(policy_name):
    wl = WORKLOADS["long"].generate(80, seed=5)
    spy = ContextSpy()
    engine = build_engine(
        wl, make_policy(policy_name, cost=spy), 25.0, actual_cost=spy, kv_capacity_tokens=25_000, max_batch_size=12
    )
    spy.engine = engine
    ContextSpy.checks = 0
    result = engine.run()
    assert ContextSpy.checks >= result.num_iterations and result.preemptions > 0  # preemptions exercised too


def test_a_chunk_spread_over_prompts_is_priced_piece_by_piece_for_the_decision_and_the_clock():
    """The prompts on offer reach a piece-aware cost before each decision; with it as the
    actual cost too, SLOWeave-multi's iterations never overrun the budget it planned."""
    import warnings

    from sloweave.core.costs.profile import profile_cost

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cost = profile_cost(str(Path(__file__).parent / "fixtures" / "profiles" / "tiny"))
        offers, contexts = [], []
        set_offer, set_context = cost.set_offer, cost.set_context
        cost.set_offer = lambda offered: (offers.append(list(offered)), set_offer(offered))
        cost.set_context = lambda kv, prefix: (contexts.append((kv, prefix)), set_context(kv, prefix))
        wl = WORKLOADS["chat"].generate(200, seed=1, rate_scale=4.0)
        result = simulate(wl, make_policy("sloweave-multi", cost=cost), 6.0, actual_cost=cost)
    several = np.bincount(result.prefill_iter, minlength=result.num_iterations) > 1
    assert several.any() and len(offers) == result.num_iterations
    assert all(prefix == 0 for offer in offers for _, prefix in offer[1:])  # only the head can be part-done
    took = result.iter_end_ms - result.iter_start_ms
    decided = np.isfinite(result.iter_budget_ms) & ~result.iter_infeasible
    assert np.all(took[decided] <= result.iter_budget_ms[decided] + 1e-9)
    # the clock priced the pieces: an iteration with several prompts costs what predict_pieces says
    for k in np.flatnonzero(several)[:20]:
        kv, head_prefix = contexts[k]
        pieces = [(int(t), 0) for t in result.prefill_tokens[result.prefill_iter == k]]
        pieces[0] = (pieces[0][0], head_prefix)
        assert took[k] == pytest.approx(cost.predict_pieces(int(result.iter_decodes[k]), kv, pieces), rel=1e-9)


def test_a_size_grid_rounds_the_steps_the_deadline_cut_short_and_nothing_else():
    """``step_grid_tokens``: the simulator rounds a deadline-aware step (decodes + chunk) down to the
    grid where the deadline cut the chunk short, as the plug-in's controller does (core/size_grid.py);
    deadlines still hold, and a static rule's chunks are its own."""
    wl = WORKLOADS["mixed"].generate(300, seed=3, rate_scale=4.0)
    policy = SLOWeave(max_chunk_tokens=1024)
    free, grid = (simulate(wl, policy, 8.0, step_grid_tokens=g) for g in (1, 32))
    decodes, chunks = grid.iter_decodes, grid.iter_chunk_tokens
    cut = (chunks > 0) & (chunks < 1024) & np.isfinite(grid.iter_budget_ms)
    on = (decodes + chunks) % 32 == 0
    # off the grid: a chunk that took a prompt's whole rest, or could not round and keep a chunk
    free_cut = (free.iter_chunk_tokens > 0) & (free.iter_chunk_tokens < 1024)
    free_on = (free.iter_decodes + free.iter_chunk_tokens) % 32 == 0
    assert cut.sum() > 500 and on[cut].mean() > 0.5 and free_on[free_cut].mean() < 0.1
    took = grid.iter_end_ms - grid.iter_start_ms
    decided = np.isfinite(grid.iter_budget_ms) & ~grid.iter_infeasible
    assert np.all(took[decided] <= grid.iter_budget_ms[decided] + 1e-9)
    assert free.num_iterations != grid.num_iterations
    # the core's rule, one decision at a time: an aged chunk is the size asked for
    grid_of = SizeGrid(32, policy.max_chunk_tokens)
    assert decide_step(policy, 4, 5000, 5.0, grid=grid_of).chunk_tokens % 32 == 28
    assert decide_step(policy, 4, 5000, 0.1, Aging(1.0, 100), 5.0, grid=grid_of) == (100, True, True)
    fixed = make_policy("sarathi-300")
    plain, rounded = (simulate(wl, fixed, 25.0, step_grid_tokens=g) for g in (1, 32))
    assert plain.iter_chunk_tokens.tolist() == rounded.iter_chunk_tokens.tolist()
    with pytest.raises(ValueError, match="step_grid_tokens"):
        simulate(wl, policy, 25.0, step_grid_tokens=0)
