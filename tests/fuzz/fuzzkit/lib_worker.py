"""The public ckpt_tools API, in a sandboxed process: ``ct.inspect`` and ``ct.scan`` on one file
per request (the scan's answer under ``"scan"``).

Run as a script by :class:`fuzzkit.workers.Worker` under an address-space limit, so that a
hostile input that makes the library allocate or loop cannot take the test process with it.
Answers ``{"ok": true, "info": <CheckpointInfo.to_json()>, "seconds": ...}``, or for a
``CheckpointError`` ``{"ok": false, "exit_code": ..., "message": ...}``, or for anything else
``{"ok": false, "crash": "<type>", "traceback": ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


def answer(request: dict[str, Any]) -> dict[str, Any]:
    import ckpt_tools as ct

    torch_before = "torch" in sys.modules
    start = time.monotonic()
    try:
        info = ct.inspect(request["path"], select=request.get("select"))
        result: dict[str, Any] = {"ok": True, "info": info.to_json()}
    except ct.CheckpointError as e:
        result = {
            "ok": False,
            "error": type(e).__name__,
            "exit_code": e.exit_code,
            "message": str(e)[:2000],
        }
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        result = {
            "ok": False,
            "crash": type(e).__name__,
            "message": str(e)[:500],
            "traceback": "".join(traceback.format_exception(e))[-3000:],
        }
    result["seconds"] = time.monotonic() - start
    result["scan"] = _scan(request["path"])
    result["torch_imported"] = not torch_before and "torch" in sys.modules
    return result


def _scan(path: str) -> dict[str, Any]:
    """``ct.scan`` of the same file: its verdict and findings, or the crash."""
    import ckpt_tools as ct

    try:
        (found,) = ct.scan([path]).files
        return found.to_json()
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return {
            "crash": type(e).__name__,
            "message": str(e)[:500],
            "traceback": "".join(traceback.format_exception(e))[-3000:],
        }


def main() -> None:
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import ckpt_tools  # noqa: F401

    for line in sys.stdin:
        result = answer(json.loads(line))
        channel.write(json.dumps(result, default=repr) + "\n")
        channel.flush()


if __name__ == "__main__":
    main()
