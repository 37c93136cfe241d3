"""The measurement path on the real CPU engine: ``engine_driver.run_workload`` (a timed workload
replayed in real time, what the benchmarks report) and ``profile_steps`` (the step-time profile
``sloweave fit`` reads). A short run each, a few requests of a few tokens; what is checked holds on
every run, however fast the machine is: every request and token accounted for, each step's rows
consistent with what vLLM scheduled in it, times finite and ordered.
"""

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from sloweave.cli import main
from sloweave.core.costs.step_profiles import REQUIRED_COLUMNS, read_profile, validate_profile, write_profile
from sloweave.sim.workloads import Workload
from sloweave.vllm_plugin.engine_driver import profile_steps, run_workload, scheduler_of

from real_engine import CPU_ANALYTIC, PLUGIN, VOCAB, cpu_engine


class Spy:
    """Records, around the engine, in order: every request added (``("add", id, prompt tokens,
    max_tokens, extra_args)``) and every ``step()`` call (``("step", scheduled, outputs, count)``:
    request -> tokens vLLM scheduled in it, request -> (new tokens, finished) it returned)."""

    def __init__(self, engine) -> None:
        self.events = []
        scheduler = scheduler_of(engine)
        schedule, add_request, step = scheduler.schedule, engine.add_request, engine.step
        scheduled = []

        def logged_schedule(*args, **kwargs):
            output = schedule(*args, **kwargs)
            scheduled.append(dict(output.num_scheduled_tokens))
            return output

        def logged_add(request_id, prompt, params, *args, **kwargs):
            self.events.append(
                ("add", request_id, len(prompt["prompt_token_ids"]), params.max_tokens, params.extra_args)
            )
            return add_request(request_id, prompt, params, *args, **kwargs)

        def logged_step():
            scheduled.clear()
            outputs = step()
            ran = {}
            for tokens in scheduled:
                for request_id, n in tokens.items():
                    # inside the engine an id is the caller's plus "-" and 8 random characters
                    # (the ids here hold no "-")
                    external = request_id.rsplit("-", 1)[0]
                    ran[external] = ran.get(external, 0) + n
            out = {o.request_id: (len(o.outputs[0].token_ids) if o.outputs else 0, o.finished) for o in outputs}
            self.events.append(("step", ran, out, len(outputs)))
            return outputs

        scheduler.schedule, engine.add_request, engine.step = logged_schedule, logged_add, logged_step

    @property
    def added(self):
        return [event[1:] for event in self.events if event[0] == "add"]

    @property
    def steps(self):
        return [event[1:] for event in self.events if event[0] == "step"]


def test_run_workload_accounts_for_every_request_token_and_step(release):
    engine = cpu_engine(PLUGIN, {"tpot_ms": 80.0, "analytic": CPU_ANALYTIC}, max_num_batched_tokens=256)
    release(engine)
    spy = Spy(engine)
    # five requests, two arriving together, three later; prompts longer than the 256-token budget
    # are chunked; outputs of 1 (done at its prefill) to 8 tokens
    workload = Workload(
        "measured", np.array([0.0, 0.0, 0.05, 0.1, 0.1]), np.array([40, 600, 300, 25, 120]), np.array([6, 8, 1, 5, 3])
    )
    run = run_workload(engine, workload, VOCAB, seed=0, tpot_ms=80.0)
    n = len(workload)

    # every request was added once, as the workload says, with the run's target
    assert [(int(r), p, m) for r, p, m, _ in spy.added] == [
        (i, int(workload.prompt_tokens[i]), int(workload.output_tokens[i])) for i in range(n)
    ]
    assert all(extra == {"sloweave_tpot_ms": 80.0} for *_, extra in spy.added)
    # ... and finished with exactly the tokens it asked for
    requests = run.requests
    assert list(requests["request"]) == list(range(n)) and (requests["status"] == "finished").all()
    assert (requests["prompt_tokens"].to_numpy() == workload.prompt_tokens).all()
    assert (requests["output_tokens"].to_numpy() == workload.output_tokens).all()
    emitted = {str(i): 0 for i in range(n)}
    finished = set()
    for _, out, _ in spy.steps:
        for request_id, (tokens, done) in out.items():
            emitted[request_id] += tokens
            if done:
                finished.add(request_id)
    assert emitted == {str(i): int(workload.output_tokens[i]) for i in range(n)} and finished == set(emitted)

    # one row per step() call, in order, each with the outputs that call returned
    steps = run.steps
    assert len(steps) == len(spy.steps) > 0
    assert steps["requests_out"].tolist() == [count for *_, count in spy.steps]
    start, end = steps["start_ms"].to_numpy(), steps["end_ms"].to_numpy()
    assert np.isfinite(start).all() and np.isfinite(end).all()
    assert (start >= 0).all() and (end > start).all() and (start[1:] >= end[:-1]).all()
    assert 0 < end[-1] <= run.wall_s * 1000.0

    # what vLLM scheduled: each prompt's chunks add up to the prompt, then one token a step for
    # each output token after the first (no preemption in a run this small)
    for i in range(n):
        request_id = str(i)
        chunks, decodes, started = [], [], False
        for ran, out, _ in spy.steps:
            if request_id in ran:
                (decodes if started else chunks).append(ran[request_id])
            if out.get(request_id, (0, False))[0]:
                started = True
        assert sum(chunks) == workload.prompt_tokens[i], (i, chunks)
        assert decodes == [1] * (int(workload.output_tokens[i]) - 1), (i, decodes)
    assert max(sum(ran.values()) for ran, *_ in spy.steps) <= 256  # the engine's token budget

    # per request: its first token after its arrival, at a step's end; its last at another's
    first_ms = requests["arrival_ms"] + requests["ttft_ms"]
    assert (requests["ttft_ms"] > 0).all() and np.isfinite(requests["ttft_ms"]).all()
    assert all(np.isclose(end, t, rtol=0, atol=1e-6).any() for t in first_ms)
    assert all(np.isclose(end, t, rtol=0, atol=1e-6).any() for t in requests["finish_ms"])
    assert (requests["finish_ms"] >= first_ms - 1e-6).all()
    single = requests["output_tokens"] == 1
    assert (requests.loc[single, "max_tpot_ms"] == 0).all()
    assert (requests.loc[~single, "max_tpot_ms"] >= requests.loc[~single, "p99_tpot_ms"]).all()
    assert (requests.loc[~single, "p99_tpot_ms"] > 0).all()


def test_profile_steps_measures_the_steps_it_names_in_the_profile_format_fit_reads(release, tmp_path):
    engine = cpu_engine(max_num_batched_tokens=512)  # vLLM's own scheduler: nothing cuts the chunk
    release(engine)
    spy = Spy(engine)
    decodes, chunks, contexts, repeats = (0, 1, 3), (0, 16, 64, 128), (32,), 2  # 11 points: enough for a fit
    profile = profile_steps(engine, VOCAB, decodes, chunks, contexts, repeats=repeats, seed=0)

    grid = [(n, c, x) for x in contexts for n in decodes for c in chunks if n or c]
    # the whole grid once per repeat: a slow spell of the machine lands on one repeat of several
    # points, and each point's fastest repeat (what the fit checks) escapes it
    assert list(zip(profile["n_decodes"], profile["chunk_tokens"], profile["context_tokens"])) == grid * repeats
    assert profile["repeat"].tolist() == [r for r in range(repeats) for _ in grid]
    assert (profile["decode_kv_tokens"] == profile["n_decodes"] * (profile["context_tokens"] + 2)).all()
    assert (profile["prefill_prefix_tokens"] == 0).all()
    assert np.isfinite(profile["step_ms"]).all() and (profile["step_ms"] > 0).all()

    # the warm-up ran first, untimed: twice the grid's largest point (3 decodes of 32 tokens, a
    # 128-token prompt), and nothing of the grid before it ended
    adds = [(request_id, tokens) for kind, request_id, tokens, *_ in spy.events if kind == "add"]
    assert [tokens for request_id, tokens in adds[:8]] == [32, 32, 32, 128] * 2
    assert all(r.startswith("w") for r, _ in adds[:8]) and not any(r.startswith("w") for r, _ in adds[8:])

    # each measured step held exactly what its row names: the n requests started before it, one
    # token each, and the whole c-token prompt added right before it
    measured = measured_steps(spy)
    assert [(len(decoding), sum(chunk.values())) for decoding, chunk, _ in measured] == list(
        zip(profile["n_decodes"], profile["chunk_tokens"])
    )
    assert all(set(decoding.values()) <= {1} and not others for decoding, _, others in measured)

    # the profile format: validated, written and read back as it was
    assert set(REQUIRED_COLUMNS) <= set(profile.columns)
    path = write_profile(profile, tmp_path / "profile.csv")
    columns = [*REQUIRED_COLUMNS, "context_tokens"]
    pd.testing.assert_frame_equal(read_profile(path)[columns], validate_profile(profile)[columns])
    # ... whose rows are enough for `sloweave fit`. Whether this minute's times deserve a fit is
    # the fit's call (it refuses times that do not grow with the load, as a busy CPU can give):
    # the rows are fitted here timed by a fixed model, so that only their grid and columns count.
    steady = profile.assign(
        step_ms=1.0 + 0.3 * profile["n_decodes"] + 0.01 * profile["chunk_tokens"] + 0.001 * profile["decode_kv_tokens"]
    )
    path = write_profile(steady, tmp_path / "steady.csv")
    result = CliRunner().invoke(main, ["fit", str(path), "--out", str(tmp_path / "fit.json")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "fit.json").stat().st_size > 0


def test_a_profile_point_whose_decodes_take_several_prefill_steps_times_every_decode_it_names(release):
    """Four 300-token prompts under a 512-token budget take three steps to prefill: with a fixed
    short output the first ones had finished before the timed step (3 decodes timed, recorded as
    4). Each decode runs until the point is timed, and its KV read is what it had made by then."""
    engine = cpu_engine(max_num_batched_tokens=512)
    release(engine)
    spy = Spy(engine)
    profile = profile_steps(engine, VOCAB, (4,), (0, 64), (300,), repeats=1, seed=0, warmup_steps=0)
    measured = measured_steps(spy)
    assert [len(decoding) for decoding, _, _ in measured] == [4, 4]
    assert all(set(decoding.values()) == {1} and not others for decoding, _, others in measured)
    # some decodes made tokens while the later prompts prefilled: more than 4 x (300 + 2) read
    assert (profile["decode_kv_tokens"] > 4 * 302).all()
    assert not engine.has_unfinished_requests()  # aborted once timed


def test_a_profile_chunk_over_several_prompts_runs_them_all_in_the_timed_step_and_names_them(release):
    """A 64-token first chunk also timed as four 16-token prompts (``pieces``): all four computed
    whole in the timed step, beside the decodes, and the row's ``offer`` names them, so the fit can
    tell the chunk's size from its attention; a point the engine cannot hold in one step is refused."""
    engine = cpu_engine(max_num_batched_tokens=512)
    release(engine)
    spy = Spy(engine)
    profile = profile_steps(engine, VOCAB, (0, 2), (64,), (32,), repeats=1, seed=0, warmup_steps=0, pieces=(1, 4))
    assert list(zip(profile["n_decodes"], profile["offer"])) == [(0, ""), (2, ""), (0, "16:0;16:0;16:0;16:0"), (2, "16:0;16:0;16:0;16:0")]  # fmt: skip
    measured = measured_steps(spy)
    assert [sorted(chunk.values()) for _, chunk, _ in measured] == [[64], [64], [16] * 4, [16] * 4]
    assert [len(decoding) for decoding, _, _ in measured] == [0, 2, 0, 2]
    assert validate_profile(profile)["offer"].tolist() == profile["offer"].tolist()
    with pytest.raises(ValueError, match="must hold the whole point in one step"):
        profile_steps(engine, VOCAB, (2,), (1024,), (32,), repeats=1, seed=0, warmup_steps=0)


def test_profile_steps_measures_later_chunks_after_a_cached_prefix_and_refuses_an_engine_without_the_cache(release):
    """A chunk that starts p tokens into its prompt: the prefix runs first as a prompt of its own,
    and the timed step computes exactly the c new tokens (vLLM reports the p before them as
    cached, which ``profile_steps`` checks). Without prefix caching the point is refused."""
    engine = cpu_engine(max_num_batched_tokens=512, enable_prefix_caching=True)
    release(engine)
    spy = Spy(engine)
    profile = profile_steps(engine, VOCAB, (0, 2), (0, 64), (32,), repeats=1, seed=0, warmup_steps=0, prefixes=(0, 256))
    assert list(zip(profile["n_decodes"], profile["chunk_tokens"], profile["prefill_prefix_tokens"])) == [
        (0, 64, 0), (2, 0, 0), (2, 64, 0), (0, 64, 256), (2, 64, 256)
    ]  # fmt: skip
    assert np.isfinite(profile["step_ms"]).all() and (profile["step_ms"] > 0).all()
    # the later chunks' steps: their prompts were the prefix plus 64 tokens, and only the 64 ran
    later = [i for i, event in enumerate(spy.events) if event[0] == "add" and event[2] == 256 + 64]
    assert len(later) == 2
    for i in later:
        request_id = spy.events[i][1]
        _, ran, out, _ = next(event for event in spy.events[i:] if event[0] == "step")
        assert ran[request_id] == 64 and out[request_id] == (1, True)

    uncached = cpu_engine(max_num_batched_tokens=512)
    release(uncached)
    with pytest.raises(ValueError, match="0 cached prefix token"):
        profile_steps(uncached, VOCAB, (0, 1), (64,), (32,), repeats=1, seed=0, warmup_steps=0, prefixes=(256,))


def measured_steps(spy: Spy) -> list[tuple[dict, dict, set]]:
    """(background request -> tokens, chunk prompt -> tokens, any other request) of each step
    profile_steps timed, found from the order of its calls: a point adds its n background requests
    (max_tokens > 1: they decode until aborted) and steps until each has its first token; then it
    adds the chunk's prompt(s) (max_tokens 1), if any, and times the next step; then it aborts the
    background and empties the engine. The warm-up's requests (``w*``, untimed, before the grid)
    are not the profile's."""
    measured, background, first, chunk = [], [], set(), []
    for event in spy.events:
        if event[0] == "add":
            _, request_id, _, max_tokens, _ = event
            if request_id.startswith("w"):
                continue
            (background if max_tokens > 1 else chunk).append(request_id)
            continue
        _, ran, out, _ = event
        if chunk or (background and set(background) <= first):  # the timed step
            others = set(ran) - set(background) - set(chunk)
            measured.append(({r: ran.get(r, 0) for r in background}, {r: ran.get(r, 0) for r in chunk}, others))
            background, chunk = [], []
        first |= {request_id for request_id, (tokens, _) in out.items() if tokens}
    return measured
