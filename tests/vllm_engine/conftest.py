import gc

import pytest


@pytest.fixture
def release():
    """Engines made in a test are shut down at its end (one at a time fits this machine)."""
    made = []
    yield made.append
    for engine in made:
        engine.engine_core.shutdown()
    made.clear()
    gc.collect()
