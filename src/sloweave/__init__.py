"""sloweave: deadline-aware adaptive chunked prefill for LLM serving.

Layers, each importing only those before it (tests/test_layers.py checks this):
``core`` (decision core) < ``sim`` (simulator) < ``studies`` < the bodies ``runtime``
(CPU, transformers) and ``vllm_plugin`` < ``cli``.
"""

from sloweave import _moved

_moved.install()
