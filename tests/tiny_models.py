"""Kept only for tests/test_cpu_backend.py, which still imports it (also inside a
fresh interpreter): the factory is tierlm.models.random_model; import it from there."""

from tierlm.models.random_model import TINY as CONFIGS  # noqa: F401
from tierlm.models.random_model import tiny_model  # noqa: F401
