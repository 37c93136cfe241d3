"""The iteration clock: how long an iteration takes, and what the cost models are told.

- the duration: ``actual_cost(n, c)`` ms, by default the policy's own cost model (an exact
  prediction); ``NoisyCost`` gives predicted x seeded noise;
- the context: a ``ContextAware`` cost (the policy's, the actual one, or the one a noisy
  cost wraps) gets the KV the decodes read and the head prompt's prefix before every
  decision, through one ``ContextFeed``; an ``OfferAware`` one also gets the prompts the chunk
  would be taken from, FCFS, as (remaining tokens, prefix), so a chunk spread over several
  prompts is priced piece by piece (each on its own prefix, each a request of the batch), the
  same way for the decision and for the iteration's time;
- the time (a duration that ``reads_clock``: the machine's measured noise with its pace): the
  simulated clock at each iteration's start, through ``set_time_ms``, None for the others;
- online correction (optional): with an ``OnlineCalibrator`` and a policy whose cost is a
  ``CalibratedCost``, every iteration's actual time is folded into the calibrator against
  the base model's prediction, as the CPU runtime does with measured step times;
- the engine loop (optional, ``EngineLoop``): the time a real engine spends between two steps,
  which the clock adds after each step (``loop_ms``, None without one) and no correction sees.
"""

from __future__ import annotations

from types import FunctionType

from sloweave.core.costs.calibrated import OnlineCalibrator
from sloweave.core.costs.engine_loop import DrawnLoop, EngineLoop
from sloweave.core.costs.protocols import Calibrated, ContextFeed


class IterationClock:
    def __init__(
        self,
        duration,
        policy_cost=None,
        correction: OnlineCalibrator | None = None,
        loop: EngineLoop | DrawnLoop | None = None,
    ) -> None:
        self.duration = duration
        self.correction = correction
        self.loop_ms = None if loop is None else loop.after_step
        self._corrected = policy_cost
        if correction is not None and not (
            isinstance(policy_cost, Calibrated) and policy_cost.calibrator is correction
        ):
            raise ValueError(
                "online correction needs the policy's cost to be a CalibratedCost built on that calibrator"
            )
        # Costs that read the KV context get it before every decision (each model once); costs
        # that price the prefill piece by piece also get the prompts on offer. Sorted once, here.
        # ``getattr`` and ``hasattr`` ask what the protocols' ``isinstance`` would (``Wrapper``: has a
        # ``cost``; ``ContextAware``: has ``set_context``, among others), without their cost per run.
        inner = getattr(duration, "cost", None)
        self._feed = feed = ContextFeed(*(m for m in (policy_cost, duration, inner) if hasattr(m, "set_context")))
        self.reads_context = feed.reads_context
        self.reads_offer = feed.reads_offer
        # One model to tell (the usual case): its own methods, one call less per decision each.
        self.set_offer = feed.offer_models[0].set_offer if len(feed.offer_models) == 1 else feed.set_offer
        self._decode_kv = self._prefix = 0
        self.set_time_ms = duration.set_time_ms if getattr(duration, "reads_clock", False) else None
        if correction is None:
            # nothing to learn: the cost itself (one call less per iteration), and a cost object's
            # bound ``__call__`` at that, which CPython calls faster than the object
            own_call = isinstance(getattr(type(duration), "__call__", None), FunctionType)
            self.iteration_ms = duration.__call__ if own_call else duration
            # nor a context to keep for it
            models = feed.context_models
            self.set_context = models[0].set_context if len(models) == 1 else feed.set_context

    def set_context(self, decode_kv_tokens: int, prefill_prefix_tokens: int) -> None:
        """The step's context, to the models that read it and, with correction, kept for its base prediction."""
        self._decode_kv, self._prefix = decode_kv_tokens, prefill_prefix_tokens
        self._feed.set_context(decode_kv_tokens, prefill_prefix_tokens)

    def iteration_ms(self, n_decodes: int, chunk_tokens: int) -> float:
        """The time the iteration really takes (and, with correction, what it teaches)."""
        actual_ms = self.duration(n_decodes, chunk_tokens)
        if self.correction is not None:
            base_ms = self._corrected.base.predict(n_decodes, chunk_tokens, self._decode_kv, self._prefix)
            self.correction.observe(n_decodes, chunk_tokens, base_ms, actual_ms)
        return actual_ms
