"""The plug-in sees every queue vLLM schedules from: KV-holding waiting requests, remote KV loads.

vLLM keeps a second waiting queue (``kv_holding_waiting``) for requests that already hold KV
blocks (a finished remote KV load, a resumed or streaming session, a disaggregated decode
worker's request with all but its last prompt token computed) and drains it before
``waiting``. A prompt whose KV was loaded whole recomputes its last token to sample. A plan
that misses either hands vLLM a budget of 0 and the request never finishes.
"""

import numpy as np
from vllm.config import KVTransferConfig
from vllm.v1.request import RequestStatus

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.vllm_plugin import SLOWeaveAsyncScheduler, SLOWeaveScheduler
from sloweave.vllm_plugin.offline import OfflineEngine, build_scheduler, make_request

COST = AnalyticCost()


def engine(cls=SLOWeaveScheduler, overlap=False, kv_transfer_config=None, **config):
    scheduler = build_scheduler(cls, kv_transfer_config=kv_transfer_config, additional_config={"sloweave": config})
    return OfflineEngine(scheduler, step_ms=lambda d, p: COST(d, p), overlap=overlap)


def holding_kv(prompt_tokens: int, computed_tokens: int, output_tokens: int, request_id: str):
    """A request that arrives with KV computed elsewhere (vLLM puts it in kv_holding_waiting)."""
    request = make_request(prompt_tokens, output_tokens, request_id=request_id)
    request.num_computed_tokens = computed_tokens
    return request


def test_a_request_holding_kv_is_scheduled_when_nothing_else_runs():
    # a disaggregated decode worker: every prompt token but the last computed by the prefill worker
    eng = engine(tpot_ms=25.0)
    eng.add(holding_kv(300, 299, 5, "decode-side"))
    assert len(eng.scheduler.kv_holding_waiting) == 1 and not eng.scheduler.waiting
    first = eng.step()
    assert first is not None and first.num_scheduled_tokens == {"decode-side": 1}
    eng.run(max_steps=50)
    assert eng.finished == {"decode-side"} and len(eng.token_times_ms["decode-side"]) == 5


def test_kv_holding_requests_are_counted_first_as_vllm_schedules_them():
    # a resumed session with 300 tokens left, then an ordinary prompt; nothing running
    eng = engine(tpot_ms=25.0, max_chunk_tokens=400)
    eng.add(make_request(1000, 3, request_id="fresh"))
    eng.add(holding_kv(500, 200, 3, "resumed"))
    states = []
    plan_step = eng.scheduler.sloweave.plan_step
    eng.scheduler.sloweave.plan_step = lambda state: states.append(state) or plan_step(state)
    first = eng.step()
    # the plan offers the resumed request's 300 tokens first, then the prompt (up to C_max)
    assert states[0].prompts_on_offer[0] == (300, 200) and states[0].pending_prompt_tokens == 1300
    assert states[0].oldest_prompt_id == "resumed"
    assert first.num_scheduled_tokens == {"resumed": 300, "fresh": 100}
    eng.run(max_steps=200)
    assert eng.finished == {"fresh", "resumed"}


def _remote_kv_engine(tmp_path, **config):
    # vLLM's own example connector: the scheduler runs its real remote-KV paths
    kv = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )
    return engine(kv_transfer_config=kv, **config)


def _whole_prompt_loaded(eng, prompt_tokens: int, output_tokens: int, request_id: str, finished: bool = True):
    """A request whose whole prompt a connector loaded asynchronously, as vLLM's admission leaves
    it (blocks allocated, every prompt token computed, waiting for the remote KV)."""
    request = make_request(prompt_tokens, output_tokens, request_id=request_id)
    blocks = eng.scheduler.kv_cache_manager.allocate_slots(
        request, 0, num_external_computed_tokens=prompt_tokens, delay_cache_blocks=True
    )
    assert blocks is not None
    request.num_computed_tokens = prompt_tokens
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    eng.add(request)
    if finished:  # the worker reported the load done
        eng.scheduler.finished_recving_kv_req_ids.add(request_id)
    return request


def test_a_fully_transferred_prompt_gets_the_token_vllm_recomputes(tmp_path):
    eng = _remote_kv_engine(tmp_path, tpot_ms=25.0)
    _whole_prompt_loaded(eng, 256, 4, "pd")
    first = eng.step()
    assert first is not None and first.num_scheduled_tokens == {"pd": 1}
    assert eng.scheduler.last_plan.token_budget == 1
    eng.run(max_steps=50)
    assert eng.finished == {"pd"} and len(eng.token_times_ms["pd"]) == 4


def test_a_fully_transferred_prompt_is_served_beside_running_decodes(tmp_path):
    eng = _remote_kv_engine(tmp_path, tpot_ms=25.0)
    for i in range(4):
        eng.add(make_request(64, 40, request_id=f"d{i}"))
    eng.step()  # their prompts; from here on they decode
    _whole_prompt_loaded(eng, 512, 3, "pd")
    step = eng.step()
    assert step.num_scheduled_tokens.get("pd") == 1 and step.decode_tokens == 4
    eng.run(max_steps=200)
    assert eng.finished == {"pd", "d0", "d1", "d2", "d3"}


def test_a_load_still_arriving_costs_nothing_and_the_prompt_behind_it_is_served(tmp_path):
    eng = _remote_kv_engine(tmp_path, tpot_ms=25.0)
    loading = _whole_prompt_loaded(eng, 256, 2, "loading", finished=False)
    eng.add(make_request(100, 2, request_id="behind"))
    step = eng.step()
    assert step.num_scheduled_tokens == {"behind": 100} and loading.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    eng.scheduler.finished_recving_kv_req_ids.add("loading")
    eng.run(max_steps=50)
    assert eng.finished == {"loading", "behind"}


def test_no_budget_ever_leaves_a_schedulable_request_with_nothing():
    """Random mixes of ordinary prompts and requests holding KV, arriving over time, at targets
    from tight to never binding: every step vLLM could run gets a budget it runs, decodes are
    never cut, and every request finishes."""
    for seed in range(12):
        rng = np.random.default_rng(seed)
        cls, overlap = [(SLOWeaveScheduler, False), (SLOWeaveAsyncScheduler, True)][seed % 2]
        eng = engine(cls, overlap=overlap, tpot_ms=float(rng.choice([2.0, 10.0, 25.0, 3_600_000.0])), aging_ms=0)
        ids = []
        for i in range(int(rng.integers(5, 15))):
            prompt, output = int(rng.integers(2, 2000)), int(rng.integers(1, 20))
            request_id = f"s{seed}-{i}"
            if rng.random() < 0.5:
                eng.add(holding_kv(prompt, int(rng.integers(1, prompt)), output, request_id))
            else:
                eng.add(make_request(prompt, output, request_id=request_id))
            ids.append(request_id)
            for _ in range(int(rng.integers(0, 3))):
                step = eng.step()
                assert step is not None, f"seed {seed}: a stalled step with requests waiting"
                assert step.token_budget >= step.decode_tokens
        eng.run(max_steps=5000)
        assert eng.finished == set(ids), f"seed {seed}"
