"""A streaming-input session on the real CPU engine: its second turn comes back through the queue
of waiting requests that hold KV blocks (vLLM's ``kv_holding_waiting``).

A resumable request stops after each turn's tokens and keeps its KV; the next turn's prompt
tokens are appended and it waits again, now holding KV. A plug-in that read only ``waiting``
planned a budget of 0 there and the session never answered its second turn.
"""

import asyncio

from sloweave.vllm_plugin.offline import tiny_model_dir

from real_engine import PLUGIN

TURNS = [list(range(10, 310)), list(range(400, 520))]  # token ids: 300 tokens, then 120 more
TOKENS_PER_TURN = 6
LIMIT_S = 120  # both turns take a few seconds once the engine is up


async def _session() -> list[int]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(tiny_model_dir()),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        enforce_eager=True,
        scheduler_cls=PLUGIN,
        seed=0,
        additional_config={"sloweave": {"tpot_ms": 40.0}},
    )
    llm = AsyncLLM.from_engine_args(args)
    params = SamplingParams(
        max_tokens=TOKENS_PER_TURN, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )

    tokens = []

    async def turns():
        for k, prompt in enumerate(TURNS):
            yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=prompt))
            # the next turn arrives after this one's answer has started (its first token is back),
            # however long that takes here
            while k + 1 < len(TURNS) and len(tokens) <= k * TOKENS_PER_TURN:
                await asyncio.sleep(0.01)

    async def collect():
        async for output in llm.generate(turns(), params, request_id="session"):
            tokens.extend(output.outputs[0].token_ids)

    try:
        await asyncio.wait_for(collect(), LIMIT_S)
    finally:
        llm.shutdown()
    return tokens


def test_a_streaming_session_answers_every_turn():
    # Greedy tokens are compared with vLLM's scheduler in test_engine.py, not here: over AsyncLLM
    # the first engine of a process drew other dummy weights than the next ones (seen with vLLM's
    # own scheduler on both sides), whatever the scheduler.
    tokens = asyncio.run(_session())
    assert len(tokens) == len(TURNS) * TOKENS_PER_TURN
