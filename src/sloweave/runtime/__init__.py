"""The measured CPU runtime: transformers' continuous batching driven by a sloweave policy.

Submodules import torch and transformers; ``import sloweave`` never does. The pieces:

- ``model``: random-weight Llama models from packaged configs (or a local model directory);
- ``scheduler``: ``PerStepChunkScheduler``, the transformers ``Scheduler`` that runs all decodes
  plus one prefill chunk of the size a callback decides, registered as ``"sloweave"``;
- ``engine``: a synchronous driver of the batch processor that owns the clock;
- online correction of the cost model from measured step times is the core's
  ``sloweave.core.costs.calibrated.self_correcting`` (``experiment.build_policy_setup``), fed by the
  runner's ``BudgetController``;
- ``runner``: runs a workload under a policy and measures per-token times, every step planned
  by the core's ``BudgetController`` as in the vLLM plug-in (a state builder and its hand-offs);
- ``profiler``: measures the step-time grid that ``sloweave.core.costs.profile_fit`` turns into cost models;
- ``commands``: the ``sloweave profile`` / ``fit`` / ``run`` commands.
"""
