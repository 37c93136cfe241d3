"""`vllm serve` with the plug-in, started and stopped by the test on loopback: streaming, metrics, bad requests."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from sloweave.vllm_plugin.offline import tiny_model_dir
from sloweave.vllm_plugin.request_check import REQUEST_TARGET_CHECK

from prometheus_server import free_port  # one loopback-port helper for every server a test starts
from real_engine import CPU_ANALYTIC, PLUGIN

START_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 120


@contextlib.contextmanager
def serving(tmp, check_targets: bool = True, **sloweave):
    """`sloweave-vllm serve` (= `vllm serve`) with the plug-in on a free loopback port; stopped on exit.
    ``sloweave``: plug-in settings over the defaults here."""
    port = free_port()
    config = {"sloweave": {"tpot_ms": 80.0, "analytic": CPU_ANALYTIC, "online_correction": True, **sloweave}}
    command = [
        sys.executable, "-m", "sloweave.vllm_plugin.cli", "serve", str(tiny_model_dir()),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
        "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager",
        "--max-model-len", "4096", "--max-num-batched-tokens", "1024",
        "--scheduler-cls", PLUGIN, "--additional-config", json.dumps(config),
    ] + (["--logits-processors", REQUEST_TARGET_CHECK] if check_targets else [])  # fmt: skip
    prometheus_dir = tmp / "prometheus"
    prometheus_dir.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prometheus_dir), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs as users run it: engine core in its own process
    log_path = tmp / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_until_up(base, process, log_path)
            yield base, log_path
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


def wait_until_up(base: str, process, log_path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"vllm serve exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"vllm serve not up after {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
        time.sleep(1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve")) as running:
        yield running


def post(base: str, body: dict):
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S)


def completion(prompt_tokens: int, max_tokens: int, **extra) -> dict:
    prompt = [10 + (7 * i) % 1000 for i in range(prompt_tokens)]
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def stream(base: str, body: dict, after_first_chunk=None) -> tuple[list[int], list[float]]:
    """Token ids of a streamed completion and the time each chunk with tokens arrived;
    ``after_first_chunk()`` is called once the first such chunk is read, before reading on."""
    tokens, times = [], []
    with post(base, {**body, "stream": True}) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])["choices"][0]
            if chunk.get("token_ids"):
                tokens.extend(chunk["token_ids"])
                times.append(time.monotonic())
                if after_first_chunk is not None and len(times) == 1:
                    after_first_chunk()
    return tokens, times


def test_streaming_completions_with_the_plug_in(server):
    base, _ = server
    body = completion(300, 16, temperature=0.0)
    tokens, times = stream(base, body)
    assert len(tokens) == 16 and all(0 <= t < 1024 for t in tokens)
    # it really streamed: the tokens came in pieces (how many depends on how fast this client and
    # the server's front end read: vLLM hands on at once what waited), and they are the reply's own
    assert len(times) >= 2
    with post(base, body) as response:
        assert tokens == json.loads(response.read())["choices"][0]["token_ids"]  # greedy: the same reply
    # a request's own target, as a client passes it
    tokens, _ = stream(base, completion(50, 8, vllm_xargs={"sloweave_tpot_ms": 40}))
    assert len(tokens) == 8


@pytest.mark.parametrize("bad", [-1, 0, "fast", 1e300])
def test_a_bad_target_gets_its_error_while_concurrent_requests_complete(server, bad):
    """The bad request is answered while two good streams are open: each has its first tokens and
    reads on only once the bad one is refused (events order them, not a sleep); two more good
    requests come after it. All four complete."""
    base, log_path = server
    results: dict[int, list[int]] = {}
    first_read: dict[int, float] = {}  # when a stream's first tokens were read
    ended: dict[int, float] = {}  # when it was read to its end
    streaming = [threading.Event() for _ in range(2)]
    answered = threading.Event()

    def good(i: int) -> None:
        def hold() -> None:  # the first two: open and under way until the bad request is answered
            if i < 2:
                streaming[i].set()
                answered.wait(REQUEST_TIMEOUT_S)

        tokens, times = stream(base, completion(200 + 150 * i, 24), after_first_chunk=hold)
        results[i], first_read[i], ended[i] = tokens, times[0], time.monotonic()

    threads = [threading.Thread(target=good, args=(i,)) for i in range(4)]
    for thread in threads[:2]:
        thread.start()
    assert all(event.wait(REQUEST_TIMEOUT_S) for event in streaming)
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(base, completion(40, 8, vllm_xargs={"sloweave_tpot_ms": bad}))
        answered_s = time.monotonic()
    finally:
        answered.set()
    for thread in threads[2:]:
        thread.start()
    for thread in threads:
        thread.join(timeout=REQUEST_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a good request did not finish"
    # the bad request was answered while the first two streams were under way
    assert all(first_read[i] < answered_s < ended[i] for i in (0, 1))
    assert refused.value.code == 400
    message = json.loads(refused.value.read())["error"]["message"]
    assert "sloweave_tpot_ms must be" in message and repr(bad) in message
    assert sorted(results) == [0, 1, 2, 3] and all(len(tokens) == 24 for tokens in results.values())
    assert urllib.request.urlopen(f"{base}/health", timeout=5).status == 200
    assert "EngineDeadError" not in log_path.read_text()


def test_decision_metrics_on_vllms_metrics_endpoint(server):
    base, _ = server
    stream(base, completion(900, 12))
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("sloweave_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    # one replica: every metric labelled with its data-parallel rank, engine "0"
    assert values['sloweave_steps_total{engine="0"}'] > 0
    assert values['sloweave_chunk_tokens_bucket{engine="0",le="+Inf"}'] == values['sloweave_steps_total{engine="0"}']
    assert values['sloweave_measured_step_ms_count{engine="0"}'] > 0
    assert values['sloweave_request_target_errors_total{engine="0"}'] == 0  # the front end refused the bad ones first
    assert any(name.startswith("vllm:") for name in (line.split(" ")[0] for line in text.splitlines()))


def test_without_the_front_end_check_a_bad_target_is_served_with_the_default(tmp_path):
    """The defect this guards against: the scheduler raised on it, which killed the engine and the server."""
    with serving(tmp_path, check_targets=False) as (base, log_path):
        results: dict[int, list[int]] = {}

        def run(i: int, **extra) -> None:
            results[i] = stream(base, completion(100 + 200 * i, 16, **extra))[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        threads.append(threading.Thread(target=run, args=(3,), kwargs={"vllm_xargs": {"sloweave_tpot_ms": -1}}))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=REQUEST_TIMEOUT_S)
        assert not any(thread.is_alive() for thread in threads), "a request did not finish"
        assert sorted(results) == [0, 1, 2, 3] and all(len(tokens) == 16 for tokens in results.values())
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        assert 'sloweave_request_target_errors_total{engine="0"} 1.0' in metrics
        log = log_path.read_text()
        assert (
            "sloweave_tpot_ms must be a finite number of milliseconds > 0 and <= 3.6e+06, got -1; serving it with the default target 80 ms"
            in log
        )
        assert "EngineDeadError" not in log
