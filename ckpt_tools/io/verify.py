"""Re-reading a written checkpoint and checking it says what was meant to be written."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import CheckpointError, VerificationError
from ckpt_tools.formats import Checkpoint, open_checkpoint
from ckpt_tools.io.tensor_bytes import iter_row_major
from ckpt_tools.structure.selection import select_state_dict

__all__ = ["VERIFY_LEVELS", "Expected", "verify_output"]

VERIFY_LEVELS = ("sizes", "full", "none")


@dataclass(frozen=True)
class Expected:
    """What the output's state dict must hold: name -> source tensor, and where it is."""

    tensors: Mapping[str, TensorRef]
    select: Sequence[str]
    source: Checkpoint


def _digest(ckpt: Checkpoint, t: TensorRef) -> bytes:
    """A hash of the tensor's elements in row-major order: views compare by their content."""
    import hashlib  # only --verify full needs it; rewrites start faster without

    span = ckpt.span(t.storage)
    h = hashlib.blake2b(digest_size=16)
    fd = os.open(span.path, os.O_RDONLY)
    try:
        for piece in iter_row_major(fd, span.offset, t):
            h.update(piece)
    finally:
        os.close(fd)
    return h.digest()


def verify_output(path: str, expected: Expected, level: str = "sizes") -> str:
    """Check a written file against what was meant to be written.

    Args:
        path: the written file (usually still the temp file).
        expected: the tensors the output's selected state dict must hold.
        level: ``sizes`` (keys, dtypes, shapes, strides, byte counts, sharing), ``full``
            (also every tensor's bytes), or ``none``.

    Returns:
        What was checked, in words.

    Raises:
        VerificationError: the output does not read back as expected.
        OSError: reading tensor bytes failed (``full``).
    """
    if level == "none":
        return "not verified (--verify none)"
    try:
        out = open_checkpoint(path)
        sd = select_state_dict(out.root, expected.select).state_dict
    except CheckpointError as e:
        raise VerificationError(f"the written file does not read back: {e}") from e
    # A rewrite carries globals through, never adds one: a global the input did not name
    # would be code the output runs (in torch.load(weights_only=False)) that nobody allowed.
    introduced = [g for g in out.unsafe_globals if g not in expected.source.unsafe_globals]
    if introduced:
        raise VerificationError(
            f"the written file names globals outside the allowlist that the input does not "
            f"({', '.join(introduced[:5])})"
        )
    got = {str(k): v for k, v in sd.items() if isinstance(v, TensorRef)}
    if list(got) != list(expected.tensors):
        missing = [k for k in expected.tensors if k not in got][:3]
        extra = [k for k in got if k not in expected.tensors][:3]
        raise VerificationError(
            f"the written file's keys differ from the planned ones (missing {missing}, "
            f"unexpected {extra})"
        )
    sharing_src: dict[int, str] = {}
    sharing_out: dict[int, str] = {}
    for name, want in expected.tensors.items():
        have = got[name]
        if (have.dtype, have.shape, have.nbytes) != (want.dtype, want.shape, want.nbytes):
            raise VerificationError(
                f"{name!r} reads back as {have.dtype} {list(have.shape)}, expected "
                f"{want.dtype} {list(want.shape)}"
            )
        # Torch outputs keep every view as it was; safetensors stores each one contiguous.
        if out.format != "safetensors" and (have.stride, have.offset) != (
            want.stride,
            want.offset,
        ):
            raise VerificationError(
                f"{name!r} reads back with strides {list(have.stride)} at storage offset "
                f"{have.offset}, expected {list(want.stride)} at {want.offset}"
            )
        first_src = sharing_src.setdefault(id(want.storage), name)
        first_out = sharing_out.setdefault(id(have.storage), name)
        if first_src != first_out and out.format != "safetensors":
            raise VerificationError(
                f"{name!r} shares storage with {first_out!r} in the output but with "
                f"{first_src!r} in the input"
            )
        if level == "full" and _digest(out, have) != _digest(expected.source, want):
            raise VerificationError(f"the bytes of {name!r} differ after writing")
    if level == "full":
        return f"verified: {len(got)} tensors, keys, sizes and bytes"
    return f"verified: {len(got)} tensors, keys and sizes"
