"""The iteration clock: how long an iteration takes, and what the cost models are told.

- the duration: ``actual_cost(n, c)`` ms, by default the policy's own cost model (an exact
  prediction); ``NoisyCost`` gives predicted x seeded noise;
- the context: a cost with ``set_context(decode_kv_tokens, prefill_prefix_tokens)`` (the
  policy's, the actual one, or the one a noisy cost wraps) gets the KV the decodes read and
  the head prompt's prefix before every decision; a cost with ``set_offer`` also gets the
  prompts the chunk would be taken from, FCFS, as (remaining tokens, prefix), so a chunk
  spread over several prompts is priced piece by piece (each on its own prefix, each a
  request of the batch), the same way for the decision and for the iteration's time;
- online correction (optional): with an ``OnlineCalibrator`` and a policy whose cost is a
  ``CalibratedCost``, every iteration's actual time is folded into the calibrator against
  the base model's prediction, as the CPU runtime does with measured step times.
"""

from __future__ import annotations

from sloweave.core.calibration import CalibratedCost, OnlineCalibrator


class IterationClock:
    def __init__(self, duration, policy_cost=None, correction: OnlineCalibrator | None = None) -> None:
        self.duration = duration
        self.correction = correction
        self._corrected = policy_cost
        if correction is not None and not (isinstance(policy_cost, CalibratedCost) and policy_cost.calibrator is correction):
            raise ValueError("online correction needs the policy's cost to be a CalibratedCost built on that calibrator")
        # Costs that read the KV context get it before every decision (each model once).
        self._context_models = []
        for model in (policy_cost, duration, getattr(duration, "cost", None)):
            if getattr(model, "set_context", None) is not None and not any(model is seen for seen in self._context_models):
                self._context_models.append(model)
        self.reads_context = bool(self._context_models)
        # Costs that price the prefill piece by piece get the prompts on offer (``set_offer``).
        self._offer_models = [m for m in self._context_models if getattr(m, "set_offer", None) is not None]
        self.reads_offer = bool(self._offer_models)
        self._decode_kv = self._prefix = 0
        if correction is None:
            self.iteration_ms = duration  # nothing to learn: the cost itself (one call less per iteration)

    def set_context(self, decode_kv_tokens: int, prefill_prefix_tokens: int) -> None:
        self._decode_kv, self._prefix = decode_kv_tokens, prefill_prefix_tokens
        for model in self._context_models:
            model.set_context(decode_kv_tokens, prefill_prefix_tokens)

    def set_offer(self, offered: list[tuple[int, int]]) -> None:
        for model in self._offer_models:
            model.set_offer(offered)

    def iteration_ms(self, n_decodes: int, chunk_tokens: int) -> float:
        """The time the iteration really takes (and, with correction, what it teaches)."""
        actual_ms = self.duration(n_decodes, chunk_tokens)
        if self.correction is not None:
            base_ms = self._corrected.base.predict(n_decodes, chunk_tokens, self._decode_kv, self._prefix)
            self.correction.observe(n_decodes, chunk_tokens, base_ms, actual_ms)
        return actual_ms
