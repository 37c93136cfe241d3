"""The measured CPU runtime: transformers' continuous batching driven by a sloweave policy.

Submodules import torch and transformers; ``import sloweave`` never does. The pieces:

- ``model``: random-weight Llama models from packaged configs (or a local model directory);
- ``scheduler``: ``SLOWeaveScheduler``, the transformers ``Scheduler`` that runs all decodes
  plus one prefill chunk of the size a callback decides, registered as ``"sloweave"``;
- ``engine``: a synchronous driver of the batch processor that owns the clock;
- online correction of the cost model from measured step times is the core's
  ``sloweave.core.calibration.self_correcting`` (``experiment.build_policy``; the runner feeds it);
- ``runner``: runs a workload under a policy and measures per-token times;
- ``profiler``: measures the step-time grid that ``sloweave.core.fit`` turns into cost models;
- ``commands``: the ``sloweave profile`` / ``fit`` / ``run`` commands.
"""
