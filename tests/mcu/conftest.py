"""Fixtures of the MCU runtime tests."""

from tests.mcu.test_runtime_lib import rt  # noqa: F401  (session fixture: the built runtime)
