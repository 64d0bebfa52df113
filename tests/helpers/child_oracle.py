"""torch asked in a child process: a script that prints one JSON line per file it is given.

A fresh process answers as a user's fresh ``import torch`` would: what this test process
imported (``torch._dynamo``, safe globals added by other tests) cannot change the answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def json_per_path(script: str, *paths: Path, timeout: float = 300) -> list[dict[str, Any]]:
    """Run ``script`` with ``paths`` as its arguments; the JSON line it printed for each."""
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(paths) :]]
