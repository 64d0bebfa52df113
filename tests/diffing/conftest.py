"""Fixtures the diff tests share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

#: ``save(state_dict, name)``: the state dict saved with torch.save in the test's folder.
Save = Callable[[dict[str, Any], str], str]


@pytest.fixture
def save(tmp_path: Path) -> Save:
    def _save(sd: dict[str, Any], name: str) -> str:
        torch.save(sd, tmp_path / name)
        return str(tmp_path / name)

    return _save
