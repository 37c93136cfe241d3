"""Profile format and cost-model fitting (sloweave.core.costs.step_profiles, .profile_fit, .fitted): no torch needed."""

from __future__ import annotations

import itertools

import json
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from sloweave.core.costs.protocols import check_monotone_in_chunk
from sloweave.core.costs.fitted import (
    REGRESSION_TERMS,
    FixedContextCost,
    LookupTableCost,
    RegressionCost,
    ResidualMargin,
    nnls,
    regression_features,
)
from sloweave.core.costs.calibrated import self_correcting
from sloweave.core.costs.profile_fit import fit_profile
from sloweave.core.costs.step_profiles import ProfileError, format_offer, read_profile, write_profile
from sloweave.sim.metrics import evaluate
from sloweave.core.policy import SLOWeave, make_policy
from sloweave.sim.engine import simulate
from sloweave.sim.workloads import WORKLOADS

TRUE_COEF = np.array([1.0, 0.5, 0.05, 0.3, 0.02, 0.4, 0.8, 0.0, 0.0, 0.0])


def synthetic_profile(
    noise: float = 0.03,
    seed: int = 0,
    repeats: int = 3,
    coef: np.ndarray = TRUE_COEF,
    prefixes=(0,),
    pieces=(1,),
    chunks=(0, 16, 64, 128, 256, 512, 1024),
) -> pd.DataFrame:
    """A grid profile: the regression's own form times one-sided lognormal noise (contention only
    adds time); its chunks at each of ``prefixes`` (0: a prompt's first chunk), and first chunks
    also spread evenly over each count of prompts in ``pieces`` (an ``offer``)."""
    rng = np.random.default_rng(seed)
    rows = []
    for context in (64, 256, 1024):
        for n in (0, 1, 4, 8, 16, 32):
            for c, p, k in itertools.product(chunks, prefixes, pieces):
                if (n == 0 and c == 0) or (c == 0 and p > 0) or (k > 1 and (p > 0 or c // k < 16)):
                    continue
                offer = [(c // k, 0)] * k if k > 1 else None
                pairs = None if offer is None else (k * (c // k) ** 2 / 2, 0.0)
                for r in range(repeats):
                    d = n * (context + 1)
                    t = float(regression_features(n, c, d, p, pairs) @ coef) * float(np.exp(abs(rng.normal(0, noise))))
                    rows.append(
                        dict(
                            n_decodes=n,
                            chunk_tokens=c,
                            decode_kv_tokens=d,
                            prefill_prefix_tokens=p,
                            step_ms=t,
                            context_tokens=context,
                            repeat=r,
                            split="fit",
                            offer=format_offer(offer),
                        )
                    )
            for _ in range(3):  # off-grid held-out steps, some with a prefix
                c, p = int(rng.integers(1, 1024)), int(rng.integers(0, 512))
                d = n * (context + 1)
                t = float(regression_features(n, c, d, p) @ coef) * float(np.exp(abs(rng.normal(0, noise))))
                rows.append(
                    dict(
                        n_decodes=n,
                        chunk_tokens=c,
                        decode_kv_tokens=d,
                        prefill_prefix_tokens=p,
                        step_ms=t,
                        context_tokens=context,
                        repeat=0,
                        split="holdout",
                    )
                )
    return pd.DataFrame(rows)


def test_regression_recovers_the_true_model_and_scores_holdout():
    result = fit_profile(synthetic_profile())
    assert result.regression.coefficients.shape == (len(REGRESSION_TERMS),)
    assert np.all(result.regression.coefficients >= 0)
    holdout = result.report["regression_holdout"]
    assert holdout["steps"] == 54
    assert holdout["median_abs_rel_error"] < 0.05
    # The context terms are what makes long-context steps predictable.
    assert (
        result.report["regression_without_context_holdout"]["median_abs_rel_error"]
        > 2 * holdout["median_abs_rel_error"]
    )
    assert result.report["table_holdout"]["steps"] == 54


def test_the_regression_learns_that_a_token_costs_more_in_a_large_chunk_and_the_policy_takes_the_faster_chunk():
    """An engine whose chunk costs grow as c^2 (vLLM's CPU build): the chunk's pairs of tokens,
    c^2 / 2, are a term of their own, fitted, held out within 5 %, and the policy deciding on the
    fit takes the chunk the true model prefills fastest."""
    per_sequence = np.array([1.0, 0.5, 0.05, 0.3, 0.01, 0.4, 0.0, 12.0, 0.0, 0.0])
    result = fit_profile(synthetic_profile(coef=per_sequence))
    fitted = dict(zip(REGRESSION_TERMS, result.regression.coefficients))
    assert fitted["per_1m_chunk_pairs_ms"] == pytest.approx(12.0, rel=0.1)
    assert result.report["regression_holdout"]["median_abs_rel_error"] < 0.05
    truth = FixedContextCost(RegressionCost(per_sequence), 256)
    policy = SLOWeave(cost=FixedContextCost(result.regression, 256), max_chunk_tokens=4096)
    chunk = policy.decide(8, 8000, 60.0).chunk_tokens
    best = max(range(1, 4097), key=lambda c: c / truth(8, c) if truth(8, c) <= 60.0 else 0.0)
    assert truth(8, chunk) <= 60.0 and chunk < policy._largest_fitting(8, 8000, 60.0).chunk_tokens
    assert chunk / truth(8, chunk) >= 0.99 * best / truth(8, best)


def test_a_profile_with_later_chunks_fits_their_attention_over_the_prefix_and_one_without_leaves_it_out():
    """vLLM's CPU build (AVX-512): a 512-token chunk took 8.0 ms as a prompt's first and 22.1 ms
    after 2,048 tokens of it: attention over the prefix, about as dear per pair as the chunk's own
    pairs. A profile with later chunks fits that term; one with first chunks only has an all-zero
    column for it, and its fit is the fit without the column, coefficient for coefficient."""
    causal = np.array([1.0, 0.5, 0.05, 0.3, 0.01, 0.0, 0.0, 14.0, 14.0, 0.0])
    with_prefix = fit_profile(synthetic_profile(coef=causal, prefixes=(0, 512, 1536)))
    fitted = dict(zip(REGRESSION_TERMS, with_prefix.regression.coefficients))
    assert fitted["per_1m_prefix_pairs_ms"] == pytest.approx(14.0, rel=0.1)
    assert fitted["per_1m_chunk_pairs_ms"] == pytest.approx(14.0, rel=0.1)
    late = with_prefix.regression.predict(8, 512, 8 * 257, 2048)
    assert late == pytest.approx(RegressionCost(causal).predict(8, 512, 8 * 257, 2048), rel=0.05)

    first_only = synthetic_profile(coef=causal)
    without = fit_profile(first_only).regression.coefficients
    prefix_pairs, chunk_squared = (
        REGRESSION_TERMS.index(t) for t in ("per_1m_prefix_pairs_ms", "per_1m_chunk_squared_ms")
    )
    assert without[prefix_pairs] == 0.0 and without[chunk_squared] == 0.0
    fit_rows = first_only[first_only["split"] == "fit"]
    x = regression_features(*(fit_rows[k] for k in ("n_decodes", "chunk_tokens", "decode_kv_tokens")), 0)
    kept = [j for j in range(len(REGRESSION_TERMS)) if j not in (prefix_pairs, chunk_squared)]
    w = 1.0 / fit_rows["step_ms"].to_numpy()
    np.testing.assert_array_equal(without[kept], nnls(x[:, kept] * w[:, None], fit_rows["step_ms"].to_numpy() * w))


def test_a_profile_with_chunks_over_several_prompts_fits_the_chunks_square_and_the_policy_cuts_there():
    """vLLM's CPU build (AVX-512): a 2,048-token chunk of eight 256-token prompts cost 5.4 us a token,
    4.6 at 1,024 of eight 128-token ones, a rise that is the chunk's size, not attention. A profile
    whose chunks also span several prompts fits that term apart from the pairs, and the policy,
    offered many short prompts, takes the chunk the true model prefills fastest, well below the
    largest safe one (a fit without the term, pricing each piece's attention only, took the largest)."""
    truth_coef = np.array([1.0, 0.5, 0.05, 0.3, 0.004, 0.0, 0.0, 3.0, 3.0, 1.5])
    chunks = (0, 64, 256, 512, 1024, 2048)
    result = fit_profile(synthetic_profile(coef=truth_coef, pieces=(1, 4, 8), chunks=chunks))
    fitted = dict(zip(REGRESSION_TERMS, result.regression.coefficients))
    assert fitted["per_1m_chunk_squared_ms"] == pytest.approx(1.5, rel=0.15)
    assert fitted["per_1m_chunk_pairs_ms"] == pytest.approx(3.0, rel=0.3)
    offer = [(128, 0)] * 32
    truth, fit = RegressionCost(truth_coef), result.regression
    for cost in (truth, fit):
        cost.set_context(8 * 300, 0)
        cost.set_offer(offer)
    policy = SLOWeave(cost=fit, max_chunk_tokens=4096, max_prefills=None)
    chunk, largest = policy.decide(8, 4096, 60.0).chunk_tokens, policy._largest_fitting(8, 4096, 60.0).chunk_tokens

    def rate(c):
        return c / (truth(8, c) - truth(8, 0) + truth(1, 0))

    best = max(range(1, largest + 1), key=rate)
    assert chunk < 0.5 * largest and truth(8, chunk) <= 60.0
    assert rate(chunk) >= 0.99 * rate(best)
    no_square = fit_profile(synthetic_profile(coef=truth_coef, chunks=chunks)).regression.coefficients
    assert no_square[REGRESSION_TERMS.index("per_1m_chunk_squared_ms")] == 0.0


def test_a_chunk_spread_over_the_prompts_on_offer_pays_each_pieces_attention_not_the_first_prompts():
    """A 1,536-token chunk that finishes a document (512 tokens left after 1,536) and starts the
    next: each piece attends within its own prompt. Priced as one piece at the first's prefix it
    would cost 2.5 times the attention; the corrected cost, the policy's, prices the offer too, and
    a profile's rows are each one piece whatever offer a step set last."""
    cost = RegressionCost(np.array([1.6, 0.55, 0.033, 0.92, 0.0098, 0.0, 0.0, 13.0, 14.0, 0.0]))
    cost.set_context(16 * 300, 1536)
    one_piece = cost(16, 1536)
    cost.set_offer([(512, 1536), (2048, 0)])
    spread = cost(16, 1536)
    linear = cost.predict(16, 0, 16 * 300, 0) + 0.92 + 0.0098 * 1536
    assert spread == pytest.approx(linear + 13.0 * (512**2 / 2 + 1024**2 / 2) / 1e6 + 14.0 * 512 * 1536 / 1e6)
    assert one_piece - linear > 2.4 * (spread - linear)
    assert cost(16, 512) == cost.predict(16, 512, 16 * 300, 1536)  # within the first prompt: one piece
    cost.set_offer([(512, 1536)])  # more than the offer holds: as one piece, as before
    assert cost(16, 1536) == one_piece
    cost.set_offer([(512, 1536), (2048, 0)])
    frame = pd.DataFrame([dict(n_decodes=16, chunk_tokens=1536, decode_kv_tokens=4800, prefill_prefix_tokens=1536)])
    assert cost.predict_frame(frame)[0] == one_piece and cost(16, 1536) == spread

    correction = self_correcting(cost)
    correction.cost.set_context(16 * 300, 1536)
    correction.cost.set_offer([(512, 1536), (2048, 0)])
    assert correction.cost(16, 1536) == spread  # no steps seen: no correction yet


def test_fitted_costs_are_monotone_in_chunk_and_usable_by_the_policy():
    result = fit_profile(synthetic_profile())
    for kind in ("regression", "table"):
        cost = result.cost(kind)
        for context in (0, 5_000, 40_000):
            cost.set_context(context, 100)
            check_monotone_in_chunk(cost, 2048)
            margin = result.margin(cost)
            check_monotone_in_chunk(lambda n, c: cost(n, c) + margin(n, c), 2048)
        cost.set_context(0, 0)
        policy = SLOWeave(cost=cost, margin=result.margin(cost), max_chunk_tokens=2048)
        # More KV context read by the decodes leaves room for a smaller chunk in the same budget.
        cost.set_context(8 * 65, 0)
        short = policy.decide(8, 4000, 30.0).chunk_tokens
        cost.set_context(8 * 1025, 0)
        long = policy.decide(8, 4000, 30.0).chunk_tokens
        assert 0 < long < short, (kind, short, long)
        assert cost(8, long) + policy.margin(8, long) <= 30.0


def test_table_interpolates_exactly_on_grid_and_linearly_between():
    frame = synthetic_profile(noise=0.0, repeats=1)
    table = LookupTableCost.fit(frame[frame["split"] == "fit"])
    assert table.repaired_cells == 0
    n, c, ctx = 8, 256, 256
    exact = float(regression_features(n, c, n * (ctx + 1), 0) @ TRUE_COEF)
    assert table.predict(n, c, n * ctx, 0) == pytest.approx(exact, rel=0.02)
    lo, hi = table.predict(8, 128, 8 * 256, 0), table.predict(8, 256, 8 * 256, 0)
    assert table.predict(8, 192, 8 * 256, 0) == pytest.approx((lo + hi) / 2, rel=1e-9)
    # Beyond the largest profiled chunk it extrapolates upwards instead of clamping.
    assert table.predict(8, 2048, 8 * 256, 0) > table.predict(8, 1024, 8 * 256, 0)


def test_margin_covers_most_holdout_steps_and_grows_with_noise():
    quiet = fit_profile(synthetic_profile(noise=0.02))
    noisy = fit_profile(synthetic_profile(noise=0.2))
    assert noisy.margin_fractions.max() > quiet.margin_fractions.max()
    assert np.all(np.diff(noisy.margin_fractions, axis=1) >= 0)  # non-decreasing along c
    assert noisy.report["regression_holdout"]["covered_by_margin_share"] >= 0.8


def test_profile_round_trips_through_csv_and_json(tmp_path):
    frame = synthetic_profile(repeats=1)
    for name in ("p.csv", "p.json"):
        path = write_profile(frame, tmp_path / name, meta={"model": "synthetic"})
        back = read_profile(path)
        assert len(back) == len(frame)
        assert back["n_decodes"].dtype == np.int64
        np.testing.assert_allclose(back["step_ms"], frame["step_ms"])
    assert json.loads((tmp_path / "p.meta.json").read_text())["model"] == "synthetic"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda f: f.drop(columns=["step_ms"]), "missing column(s) step_ms"),
        (lambda f: f.assign(step_ms=-1.0), "step_ms=-1.0"),
        (lambda f: f.assign(n_decodes="many"), "n_decodes='many'"),
        (lambda f: f.assign(chunk_tokens=2.5), "chunk_tokens=2.5"),
        (lambda f: f.assign(split="train"), "unknown split"),
        (lambda f: f.assign(n_decodes=0, chunk_tokens=0), "empty step"),
        (lambda f: f.iloc[:0], "no rows"),
    ],
)
def test_corrupt_profile_gets_a_clear_error(tmp_path, mutate, message):
    path = tmp_path / "bad.csv"
    mutate(synthetic_profile(repeats=1)).to_csv(path, index=False)
    with pytest.raises(ProfileError) as err:
        fit_profile(read_profile(path))
    assert message in str(err.value)


def test_unparseable_files_get_a_clear_error(tmp_path):
    (tmp_path / "x.json").write_text('{"format": "something-else", "rows": []}')
    with pytest.raises(ProfileError, match="format='sloweave-profile'"):
        read_profile(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("{not json")
    with pytest.raises(ProfileError, match="cannot be parsed"):
        read_profile(tmp_path / "y.json")
    with pytest.raises(ProfileError, match="does not exist"):
        read_profile(tmp_path / "missing.csv")


def test_non_monotone_profile_is_rejected_and_small_noise_is_repaired():
    frame = synthetic_profile(noise=0.0, repeats=1)
    broken = frame.copy()
    cell = (broken["n_decodes"] == 4) & (broken["chunk_tokens"] == 512) & (broken["context_tokens"] == 256)
    broken.loc[cell, "step_ms"] = 0.5  # a 512-token chunk faster than a 16-token one
    with pytest.raises(
        ProfileError, match=r"not monotone in the chunk size: at n_decodes=4, context_tokens=256: chunk_tokens=512"
    ):
        fit_profile(broken)
    noisy = frame.copy()
    small = (
        (noisy["n_decodes"] == 4)
        & (noisy["chunk_tokens"] == 64)
        & (noisy["context_tokens"] == 64)
        & (noisy["split"] == "fit")
    )
    below = float(
        noisy.loc[
            (noisy["n_decodes"] == 4) & (noisy["chunk_tokens"] == 16) & (noisy["context_tokens"] == 64), "step_ms"
        ].iloc[0]
    )
    noisy.loc[small, "step_ms"] = below * 0.95  # a 5 % dip: timing noise
    table = LookupTableCost.fit(noisy[noisy["split"] == "fit"])
    assert table.repaired_cells >= 1
    check_monotone_in_chunk(table, 2048)


def test_table_needs_a_full_grid_but_the_regression_does_not():
    frame = synthetic_profile(repeats=1)
    frame = frame[~((frame["n_decodes"] == 8) & (frame["chunk_tokens"] == 128) & (frame["context_tokens"] == 64))]
    result = fit_profile(frame)
    assert "n_decodes=8, chunk_tokens=128, context_tokens=64" in result.report["table_error"]
    with pytest.raises(ProfileError, match="no lookup table"):
        result.cost("table")
    assert result.cost("regression") is result.regression


def test_regression_rejects_negative_coefficients():
    with pytest.raises(ProfileError):
        RegressionCost(np.array([1, 1, 1, 1, -0.1, 1, 1, 1.0, 1.0, 0.0]))


def test_simulator_runs_on_a_profiled_cost():
    result = fit_profile(synthetic_profile())
    cost = FixedContextCost(result.regression, context_per_decode_tokens=300)
    wl = WORKLOADS["mixed"].generate(60, seed=0, rate_scale=0.05)
    policy = make_policy("sloweave", cost, ResidualMargin(cost, result.margin_fractions), 1024)
    sim = simulate(wl, policy, tpot_ms=60.0, actual_cost=cost)
    metrics = evaluate(sim, ttft_ms=3000.0, tpot_ms=60.0)
    assert metrics.num_finished == 60
    assert (
        np.all(sim.iter_end_ms[sim.iter_decodes > 0] - sim.iter_start_ms[sim.iter_decodes > 0] <= 60.0 + 1e-6)
        or metrics.p99_tpot_ms <= 60.0
    )


def test_fit_and_policy_import_without_torch():
    code = "import sys, sloweave, sloweave.core.costs.fitted, sloweave.core.policy, sloweave.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_fit_command_reports_a_corrupt_profile_clearly(tmp_path):
    from click.testing import CliRunner

    from sloweave.cli import main

    good = write_profile(synthetic_profile(repeats=1), tmp_path / "good.csv")
    out = CliRunner().invoke(main, ["fit", str(good), "--out", str(tmp_path / "fit.json")])
    assert out.exit_code == 0, out.output
    doc = json.loads((tmp_path / "fit.json").read_text())
    assert set(doc["regression"]["coefficients"]) == set(REGRESSION_TERMS)
    assert doc["report"]["regression_holdout"]["steps"] > 0
    bad = tmp_path / "bad.csv"
    synthetic_profile(repeats=1).drop(columns=["decode_kv_tokens"]).to_csv(bad, index=False)
    out = CliRunner().invoke(main, ["fit", str(bad)])
    assert out.exit_code == 1
    assert "missing column(s) decode_kv_tokens" in out.output
    assert "Traceback" not in out.output


def test_the_shipped_cpu_profile_fits_and_drives_the_policy():
    """The real profile behind docs/cpu-runtime.md (small model, measured on this machine)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "results-cpu" / "profile-small.csv"
    result = fit_profile(read_profile(path))
    report = result.report
    assert report["holdout_source"] == "split column"
    with_context = report["regression_holdout"]["median_abs_rel_error"]
    assert with_context < report["regression_without_context_holdout"]["median_abs_rel_error"]
    assert report["regression_holdout"]["covered_by_margin_share"] >= 0.9
    cost = result.regression
    policy = SLOWeave(cost=cost, margin=result.margin(cost), max_chunk_tokens=1024)
    cost.set_context(8 * 257, 0)
    chunk = policy.decide(8, 1500, 100.0).chunk_tokens
    assert 0 < chunk < 1024
    assert cost(8, chunk) + policy.margin(8, chunk) <= 100.0 < cost(8, chunk + 1) + policy.margin(8, chunk + 1)


def test_regression_predict_matches_its_design_matrix():
    """The scalar fast path computes exactly the model's features . coefficients."""
    from sloweave.core.costs.fitted import RegressionCost, regression_features

    rng = np.random.default_rng(5)
    cost = RegressionCost(rng.uniform(0.0, 2.0, 10))
    for _ in range(200):
        n, c, d, p = (int(v) for v in rng.integers(0, 5000, 4))
        expected = float(regression_features(n, c, d, p) @ cost.coefficients)
        assert cost.predict(n, c, d, p) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def one_step_profile(**row) -> pd.DataFrame:
    step = {"n_decodes": 0, "chunk_tokens": 1000, "decode_kv_tokens": 0, "prefill_prefix_tokens": 128, "step_ms": 9.0}
    return pd.DataFrame([{**step, **row}])


@pytest.mark.parametrize(
    "offer, message",
    [
        ("900:128", "two or more prompts"),
        ("900:128;0:0", "two or more prompts of >= 1 token"),
        ("900:128;x", "'x' is not tokens:computed"),
        ("-900:128;200:0", "'-900:128' is not tokens:computed"),
        ("900:0;200:0", "does not fit the step"),  # the first prompt is not at the step's prefix
        ("1000:128;200:0", "does not fit the step"),  # the chunk ends within the first prompt
        ("900:128;50:0", "does not fit the step"),  # the chunk runs past the last prompt
    ],
)
def test_an_offer_that_does_not_fit_its_step_is_refused_naming_the_line(tmp_path, offer, message):
    path = tmp_path / "bad.csv"
    one_step_profile(offer=offer).to_csv(path, index=False)
    with pytest.raises(ProfileError, match=f"line 2: offer=.*{re.escape(message)}"):
        read_profile(path)


def test_an_offer_round_trips_and_an_empty_one_is_one_prompt(tmp_path):
    frame = pd.concat([one_step_profile(offer="900:128;200:0"), one_step_profile(chunk_tokens=512, offer=None)])
    for name in ("p.csv", "p.json"):
        back = read_profile(write_profile(frame, tmp_path / name))
        assert back["offer"].tolist() == ["900:128;200:0", ""]
