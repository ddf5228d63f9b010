"""Optional packages the tests need: skipped where absent, except in CI (env CI=true), where
`make venv` installs them and their absence fails the test instead of hiding it."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require(module: str, why: str) -> ModuleType:
    """Import ``module``; where it does not import, skip (fail under CI=true) saying ``why``."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # native libraries fail to load in their own ways
        reason = f"{module} does not import ({type(exc).__name__}: {exc}); {why}"
        if in_ci():
            pytest.fail(f"CI=true: {reason}", pytrace=False)
        pytest.skip(reason)
