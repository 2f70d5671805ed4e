from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "corpus" / "public_ds_configs"


@pytest.fixture
def repo() -> Path:
    return REPO
