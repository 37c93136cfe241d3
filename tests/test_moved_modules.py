"""The old import paths still work, warn, and give the very same module as the new one."""

import importlib
import subprocess
import sys

import pytest

from sloweave._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_is_an_alias(old):
    code = (
        "import importlib, warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        f"try:\n    importlib.import_module({old!r})\nexcept DeprecationWarning as w:\n    print(w)\n"
    )
    message = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert old in message and "has moved to" in message
    with pytest.warns(DeprecationWarning):
        sys.modules.pop(old, None)
        module = importlib.import_module(old)
    new = MOVED[old]
    if isinstance(new, str):
        assert module is importlib.import_module(new)
    else:
        for name in new:
            public = [k for k in vars(importlib.import_module(name)) if not k.startswith("_")]
            assert all(getattr(module, k) is getattr(importlib.import_module(name), k) for k in public)


def test_the_old_simulator_and_policy_paths_still_run():
    for old in ("sloweave.policy", "sloweave.simulator", "sloweave.workloads"):
        sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning):
        from sloweave.policy import make_policy
        from sloweave.simulator import simulate
        from sloweave.workloads import WORKLOADS
    result = simulate(WORKLOADS["chat"].generate(20, seed=0), make_policy("sloweave"))
    assert result.finished.all()
