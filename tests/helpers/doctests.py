"""Docstring examples: the folder they run in, and which of them run.

``--doctest-modules`` runs every ``>>>`` line of ``ckpt_tools``. Each docstring's examples
run in a fresh folder holding the files they name (:data:`EXAMPLE_FILES`), so an example
reads like user code (``inspect("ddp.pt")``) and may write files beside them.
"""

from __future__ import annotations

import doctest
from pathlib import Path

from tests.helpers.committed import copy_fixture
from tests.helpers.files import deflated_copy
from tests.helpers.lora import write_tiny_adapter

# Name in the examples' folder -> committed fixture it is a copy of.
EXAMPLE_FILES = {
    "model.pt": "plain.pt",  # a plain state dict (TinyNet: conv, norm, layers.{0..3}, head)
    "ddp.pt": "dataparallel.pt",  # the same net's state dict under nn.DataParallel (module.)
    "model.safetensors": "model.safetensors",
    "sharded": "sharded",  # an HF folder: two safetensors shards and their index
    "out": "harness",  # out/{single,dp,ddp,manual}/{wrapped,bare,trainer}.pt: harness runs
}


def fill_example_folder(folder: Path) -> None:
    """Copy :data:`EXAMPLE_FILES` into ``folder``, with ``lora`` (a PEFT LoRA adapter of
    ``model.pt``) and ``deflated.pt`` (``model.pt`` re-zipped with deflate by a zip tool)."""
    for name, fixture in EXAMPLE_FILES.items():
        copy_fixture(fixture, folder, as_name=name)
    write_tiny_adapter(folder / "lora")
    deflated_copy(folder / "model.pt", folder / "deflated.pt")


def example_sections(docstring: str) -> list[str]:
    """The text of each ``Example:`` (or ``Examples:``) section of a docstring.

    A section runs from its heading to the next non-blank line indented no deeper than the
    heading (the next section, or the end of the docstring).
    """
    lines = docstring.expandtabs().splitlines()
    sections: list[str] = []
    for i, line in enumerate(lines):
        if line.strip() not in ("Example:", "Examples:"):
            continue
        indent = len(line) - len(line.lstrip())
        body: list[str] = []
        for later in lines[i + 1 :]:
            if later.strip() and len(later) - len(later.lstrip()) <= indent:
                break
            body.append(later)
        sections.append("\n".join(body))
    return sections


def examples_that_run(text: str) -> list[doctest.Example]:
    """The ``>>>`` examples in ``text`` that doctest runs (those not marked ``+SKIP``)."""
    return [
        e for e in doctest.DocTestParser().get_examples(text) if not e.options.get(doctest.SKIP)
    ]
