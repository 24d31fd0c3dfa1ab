"""pytest fixtures for real megatron-core tests (test-only).

`mcore_pool`: one 4-rank spawned gloo pool per test module (start-up ~5-15 s per rank is paid once per module).
Use it from a test module or conftest with ``from tests.mcore.fixtures import mcore_pool  # noqa: F401``.
"""
import pytest

from tests.mcore.pool import WorkerPool


@pytest.fixture(scope="module")
def mcore_pool():
    pool = WorkerPool(4)
    try:
        yield pool
    finally:
        pool.close()
