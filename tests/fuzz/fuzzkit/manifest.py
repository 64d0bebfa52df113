"""Draft manifest entries from a campaign's log: ``python -m fuzzkit.manifest [--merge]``.

Run from ``tests/fuzz``. Reads ``findings/*.jsonl`` (what the fuzz tests wrote for findings no
manifest entry knew), prints one draft ``EXPECTED_FAILURES.json`` entry per regression file,
and with ``--merge`` adds them to the manifest (an entry already there is left alone).
Review each draft's ``what`` before committing: it is the finding's message, not a diagnosis.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .registry import EXPECTED_FILE, FINDINGS_DIR, REGRESSIONS, load_json


def drafts() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for log in sorted(FINDINGS_DIR.glob("*.jsonl")):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            name = record.get("file")
            if not name or not (REGRESSIONS / name).exists():
                continue
            entry = found.setdefault(
                name,
                {
                    "class": record["class"],
                    "signature": record["signature"],
                    "what": record["message"][:300],
                    "mutations": record["mutations"],
                },
            )
            if not entry["signature"].split(":")[2].startswith("ct."):
                entry["cli"] = True  # only the command shows it
            plan = record.get("context", {}).get("plan")
            if plan and "plan" not in entry:
                entry["plan"] = plan
            if record["signature"] != entry["signature"]:
                also = entry.setdefault("also", [])
                if record["signature"] not in also:
                    also.append(record["signature"])
    return found


def main(argv: list[str]) -> None:
    new = drafts()
    if "--merge" in argv:
        manifest = load_json(EXPECTED_FILE)
        for name, entry in new.items():
            manifest.setdefault(name, entry)
        EXPECTED_FILE.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    print(json.dumps(new, indent=2, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1:])
