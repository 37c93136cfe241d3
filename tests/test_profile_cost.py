"""The operator-profile cost model: hand-computed sums of profile rows, monotonicity, the
presets, extrapolation that is counted, and bad profile folders.

The tiny fixture (tests/fixtures/profiles/tiny, 2 layers, TP2) has round numbers:
- token-parallel ops: 9 operators of 0.1 / 0.2 / 0.3 / 0.5 ms at 1 / 64 / 128 / 256 tokens;
- all-reduce at 0.5 / 64 / 512 tokens (64 B, 8 kB, 64 kB): 0.01 / 0.02 / 0.06 ms, plus 0.02 ms launch, two per layer;
- decode attention = 0.01 n + 0.001 n (KV per decode) / 64 ms;
- prefill attention = 0.001 c + 0.0001 c p / 64 ms (profiled for c + p <= 128);
- CPU: 0.4 ms at batch 1, 0.8 ms at batch 8.
"""

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from sloweave.core.costs.step_profiles import ProfileError
from sloweave.core.costs.operator_profiles import PRESETS, load_profiles
from sloweave.core.policy import SLOWeave
from sloweave.core.costs.profile import ProfileCost, isotonic, profile_cost

TINY = Path(__file__).parent / "fixtures" / "profiles" / "tiny"


@pytest.fixture(scope="module")
def tiny():
    return profile_cost(str(TINY))


def test_an_iteration_is_the_sum_of_its_profiled_operators(tiny):
    # n = 2 decodes reading 64 KV tokens each, a 64-token chunk on an empty prefix: 66 tokens
    token_ops = 1.8 + 2 / 64 * 0.9  # between 64 (1.8 ms) and 128 tokens (2.7 ms)
    all_reduce = 2 * ((0.02 + 2 / 448 * 0.04) + 0.02)  # two per layer, each with its launch
    decode = 0.01 * 2 + 0.001 * 2 * 64 / 64
    prefill = 0.001 * 64
    cpu = 0.4 + 2 / 7 * 0.4  # batch 3 between 1 and 8
    expected = 2 * (token_ops + all_reduce + decode + prefill) + cpu
    assert tiny.predict(2, 64, 128, 0) == pytest.approx(expected, rel=1e-12)
    # decode-only: no prefill term, batch 2
    assert tiny.predict(2, 0, 128, 0) == pytest.approx(
        2 * (0.9 + 1 / 63 * 0.9 + 2 * (0.01 + 1.5 / 63.5 * 0.01 + 0.02) + decode) + 0.4 + 1 / 7 * 0.4, rel=1e-12
    )
    # a prefix between profiled ones interpolates: p = 32, half way between 0 and 64
    assert tiny.predict(0, 64, 0, 32) - tiny.predict(0, 64, 0, 0) == pytest.approx(2 * 0.0001 * 64 * 32 / 64, rel=1e-9)


def test_pieces_add_their_own_attention(tiny):
    one = tiny.predict_pieces(2, 128, [(64, 0)])
    assert one == pytest.approx(tiny.predict(2, 64, 128, 0), rel=1e-12)
    two = tiny.predict_pieces(2, 128, [(32, 64), (32, 0)])
    attention = 0.001 * 32 + 0.0001 * 32 * 64 / 64 + 0.001 * 32
    same_tokens = tiny.predict_pieces(2, 128, [(64, 0)]) - 2 * 0.064  # the same 66 tokens without prefill attention
    cpu_one_more = (0.4 + 3 / 7 * 0.4) - (0.4 + 2 / 7 * 0.4)  # batch 4 instead of 3
    assert two == pytest.approx(same_tokens + 2 * attention + cpu_one_more, rel=1e-9)
    # one chunk on the head's prefix bounds the pieces from above (what the decision uses)
    assert tiny.predict(2, 64, 128, 64) >= two - cpu_one_more


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_are_monotone_in_the_chunk_in_every_context(preset):
    cost = profile_cost(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kv, prefix in ((0, 0), (64 * 1000, 500), (128 * 3000, 4000), (8 * 50_000, 60_000)):
            cost.set_context(kv, prefix)
            for n in (0, 1, 16, 128, 300):
                values = [cost(n, c) for c in range(0, 9000, 7)]
                assert np.all(np.diff(values) >= 0), (preset, kv, prefix, n)
    SLOWeave(cost=cost)  # the policy's own check passes too


def test_presets_match_the_regimes_the_profiles_describe():
    big, small = profile_cost("llama2-70b-tp2-a100"), profile_cost("llama3-8b-tp1-a100")
    # 70B TP2: a decode-only step of linear layers is 45-60 ms; with all-reduces, attention and CPU 55-115 ms
    assert 55 < big.predict(1, 0, 512, 0) < 65 and 95 < big.predict(128, 0, 128 * 2000, 0) < 115
    # each prefill token about 0.3 ms at 1k+ tokens
    assert 0.25 < (big.predict(0, 2048, 0, 0) - big.predict(0, 1024, 0, 0)) / 1024 < 0.40
    # 8B TP1: about 10 ms of linear layers per decode step, 0.07 ms per prefill token
    assert (
        10 < small.predict(1, 0, 512, 0) < 14
        and 0.05 < (small.predict(0, 2048, 0, 0) - small.predict(0, 1024, 0, 0)) / 1024 < 0.09
    )
    # the decodes' KV context moves the cost: the regime a fixed chunk cannot follow
    assert big.predict(64, 0, 64 * 4000, 0) - big.predict(64, 0, 64 * 100, 0) > 10
    assert "derived" in small.describe()["attention"] and big.describe()["attention"] == "measured"
    assert big.shape.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 and small.shape.kv_tokens_in(1.0) == 2**30 // 131072


def test_queries_outside_the_profile_are_extrapolated_counted_and_warned_once(tiny):
    tiny.out_of_range.clear()
    with pytest.warns(UserWarning, match="extrapolated"):
        far = tiny.predict(2, 200, 2 * 1000, 0)
    assert far > tiny.predict(2, 128, 2 * 1000, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # another context: counted, not warned again
        tiny.predict(2, 0, 2 * 2000, 0)
    assert tiny.out_of_range["decode_kv"] == 2 and tiny.out_of_range["prefill_chunk"] == 1
    assert tiny.describe()["out_of_range_queries"]["decode_kv"] == 2


def test_isotonic_smooths_wobbles_instead_of_keeping_them():
    assert isotonic([1, 3, 2, 4]).tolist() == [1, 2.5, 2.5, 4]
    assert np.all(np.diff(isotonic(np.random.default_rng(0).normal(size=50).cumsum())) >= 0)


# ----------------------------------------------------------------------------- bad profile folders


def broken(tmp_path, edit) -> Path:
    folder = tmp_path / "profile"
    shutil.copytree(TINY, folder)
    edit(folder)
    return folder


def replace_in(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda f: (f / "mlp.csv").unlink(), r"mlp\.csv: missing"),
        (lambda f: (f / "model.json").unlink(), r"no model\.json"),
        (lambda f: (f / "model.json").write_text("{not json"), r"model\.json: not valid JSON"),
        (
            lambda f: (f / "model.json").write_text(json.dumps({"num_layers": 0, "tensor_parallel": 2})),
            r"num_layers must be a whole number >= 1",
        ),
        (
            lambda f: (f / "model.json").write_text(json.dumps({"num_layers": 2, "tensor_parallel": 4})),
            r"no rows for tensor parallelism 4.*profiled: \[1, 2\]",
        ),
        (lambda f: (f / "attention.csv").unlink(), r"attention\.csv: missing"),
        (lambda f: (f / "all_reduce.csv").unlink(), r"all_reduce\.csv: missing"),
        (
            lambda f: replace_in(f / "mlp.csv", "time_stats.mlp_act.median", "time_stats.mlp_activation.median"),
            r"mlp\.csv: missing column\(s\) time_stats\.mlp_act\.median",
        ),
        (
            lambda f: replace_in(f / "mlp.csv", ",0.2,0.2,0.2", ",0.2,fast,0.2"),
            r"mlp\.csv, line \d+: time_stats\.\w+\.median='fast'; expected a finite number of milliseconds >= 0 and <= 1e\+10",
        ),
        (
            lambda f: replace_in(f / "attention.csv", ",0.011,", ",-0.011,"),
            r"attention\.csv, line 3: time_stats\.attn_decode\.median=-0\.011; expected a finite number of milliseconds >= 0 and <= 1e\+10",
        ),
        (
            lambda f: replace_in(f / "attention.csv", "64,8,2,16,2,1,0,64,False", "64,16,2,16,2,1,0,64,False"),
            r"attention\.csv, line 3: n_q_head=16 does not match the model",
        ),
        (
            lambda f: replace_in(f / "attention.csv", "64,8,2,16,2,1,0,0,False", "64,8,2,16,2,1,0,0,maybe"),
            r"attention\.csv, line 2: is_prefill='maybe'",
        ),
        (
            lambda f: replace_in(f / "mlp.csv", "\n8,2,64,256,100,True,64,2", "\n8,2,64,256,100,True,64.5,2"),
            r"mlp\.csv, line \d+: num_tokens=64\.5; expected a whole number >= 0 and <= 2,147,483,648",
        ),
        (
            lambda f: (f / "mlp.csv").write_bytes(b"\x1f\x8b\x08\x00binary"),
            r"mlp\.csv: not a UTF-8 text file \(byte 1 is 0x8b; compressed or binary\?\)",
        ),
    ],
)
def test_a_bad_profile_folder_gets_an_error_naming_the_file_line_and_problem(tmp_path, edit, message):
    folder = broken(tmp_path, edit)
    with pytest.raises(ProfileError, match=message):
        profile_cost(str(folder))


def test_unknown_presets_and_missing_folders_name_the_choices(tmp_path):
    with pytest.raises(ProfileError, match="does not exist.*llama2-70b-tp2-a100"):
        load_profiles(tmp_path / "nowhere")


def test_without_cpu_overheads_the_model_says_so(tmp_path):
    folder = broken(tmp_path, lambda f: (f / "cpu_overheads.csv").unlink())
    cost = profile_cost(str(folder))
    assert not cost.describe()["cpu_overhead"] and any("cpu_overheads.csv" in n for n in cost.describe()["notes"])
    assert ProfileCost(load_profiles(TINY), cpu_overhead=False).predict(2, 64, 128, 0) == pytest.approx(
        cost.predict(2, 64, 128, 0)
    )


def test_derived_attention_scales_by_heads_per_gpu(tmp_path):
    # a one-GPU model with the tiny shape: KV heads per GPU double (2 vs 1), query heads per GPU too (8 vs 4)
    def derive(folder):
        (folder / "attention.csv").unlink()
        (folder / "model.json").write_text(
            json.dumps({"name": "tp1", "num_layers": 2, "tensor_parallel": 1, "attention": {"derived_from": str(TINY)}})
        )

    derived = profile_cost(str(broken(tmp_path, derive)))
    assert "derived from tiny-test-model TP2" in derived.describe()["attention"]
    source = profile_cost(str(TINY))
    d_decode = derived.predict(2, 0, 128, 0) - derived.predict(2, 0, 0, 0)
    s_decode = source.predict(2, 0, 128, 0) - source.predict(2, 0, 0, 0)
    assert d_decode == pytest.approx(2 * s_decode)


def test_a_policys_own_check_is_not_counted_as_queries_past_the_profile():
    cost = profile_cost("llama2-70b-tp2-a100")
    SLOWeave(cost=cost)  # checks T up to 4096 tokens next to 512 decodes (past 128 profiled)
    assert cost.describe()["out_of_range_queries"] == {}
    with pytest.warns(UserWarning):
        cost.predict(300, 0, 300 * 100, 0)
    assert cost.out_of_range["decode_batch"] == 1
