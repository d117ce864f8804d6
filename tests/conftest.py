from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# The repo root on the path: `seerd` and the fixtures (tests/fixtures) import under plain `pytest` too.
sys.path.insert(0, str(REPO_ROOT))

from tests.fixtures.make_tiny_model import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model + tokenizer, built once per test session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_model") / "model", seed=0)
