"""Re-reading a written checkpoint and checking it says what was meant to be written."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.errors import CheckpointError, VerificationError
from ckpt_tools.formats import Checkpoint, open_checkpoint
from ckpt_tools.io.ranges import SourceEndedError, fd_pread, pread_chunks
from ckpt_tools.io.tensor_bytes import decompressed, iter_row_major
from ckpt_tools.io.verify.keys import as_planned_keys
from ckpt_tools.io.verify.levels import NOT_VERIFIED, VERIFY_LEVELS
from ckpt_tools.structure.selection import select_state_dict
from ckpt_tools.structure.tensor_walk import tensors_by_place

__all__ = ["VERIFY_LEVELS", "Expected", "tensor_digest", "verify_output"]


class Expected(NamedTuple):
    """What the output's state dict must hold: name -> source tensor, and where it is.

    ``rebuilt``: the plan lists the sparse, meta and nested tensors
    (:class:`~ckpt_tools.descriptors.RebuiltTensor`) too, and they are checked and counted
    as tensors; when False (a plan of dense tensors only) the output's are not looked at.

    ``devices``: saved device tag -> the tag a torch output holds for it (a retag's mapping;
    ``{}`` when every tag is kept); None leaves the tags uncompared.
    """

    tensors: Mapping[Any, TensorRef | RebuiltTensor]
    select: Sequence[str] | None  # None: chosen in the output as in the input
    source: Checkpoint
    rebuilt: bool = False
    devices: Mapping[str, str] | None = None


def tensor_digest(ckpt: Checkpoint, t: TensorRef) -> bytes:
    """A hash of the tensor's elements in row-major order: views compare by their content.

    Of the stored bytes only (a compressed record's inflated): two tensors with one digest
    can still load as other values where their view bits or quantizer parameters differ; a
    caller comparing values compares those too (``average`` does).
    """
    import hashlib  # only --verify full needs it; rewrites start faster without

    h = hashlib.blake2b(digest_size=16)
    record = ckpt.records.get(f"data/{t.storage.key}") if t.storage.view is None else None
    if record is not None and record.compressed:
        # A re-zipped archive (torch loads it): its storage inflated once into a scratch file.
        import tempfile

        with tempfile.TemporaryFile() as staged:
            with decompressed(ckpt, f"data/{t.storage.key}") as chunks:
                for chunk in chunks:
                    staged.write(chunk)
            staged.flush()
            for piece in iter_row_major(staged.fileno(), 0, t):
                h.update(piece)
        return h.digest()
    span = ckpt.span(t.storage)
    fd = os.open(span.path, os.O_RDONLY)
    try:
        for piece in iter_row_major(fd, span.offset, t):
            h.update(piece)
    finally:
        os.close(fd)
    return h.digest()


def _record_crc(ckpt: Checkpoint, storage_key: str) -> int | None:
    """The CRC-32 of a zip record's bytes as they lie in the file."""
    import zlib

    record = ckpt.records.get(f"data/{storage_key}")
    if record is None:
        return None
    crc = 0
    fd = os.open(ckpt.path, os.O_RDONLY)
    try:
        for piece in pread_chunks(fd_pread(fd), record.data_offset, record.size):
            crc = zlib.crc32(piece, crc)
    except SourceEndedError:
        return None
    finally:
        os.close(fd)
    return crc


def _check_record_crc(out: Checkpoint, storage_key: str) -> None:
    """A written storage record's bytes match the CRC-32 its headers state (``full``).

    Records are copied with the source's CRC-32, without reading them; torch never checks
    CRCs when it loads, so a wrong one in the source would pass to the output unseen (and
    other zip tools refuse it). ``--verify full`` reads the bytes anyway, so it checks.
    """
    record = out.records.get(f"data/{storage_key}")
    if record is None or record.crc32 == 0:  # 0: torch saved it without CRCs (compute_crc32)
        return
    if _record_crc(out, storage_key) != record.crc32:
        raise VerificationError(
            f"record data/{storage_key} does not match its CRC-32: the source record's "
            "CRC-32 is wrong (torch does not check it; zip tools do); the source is damaged"
        )


def _same_bytes(
    out: Checkpoint, have: TensorRef, source: Checkpoint, want: TensorRef, crc_done: set[str]
) -> bool:
    """Whether the written tensor holds the source tensor's bytes (``--verify full``).

    ``crc_done`` holds the written records already compared whole; the caller keeps it.
    """
    record = source.records.get(f"data/{want.storage.key}")
    written = f"data/{have.storage.key}" in out.records  # a torch zip's (not safetensors)
    if record is not None and record.compressed and written:
        # A compressed source record cannot be read in place: the written record (stored,
        # same views) must have the CRC-32 the source records for its decompressed bytes.
        # One comparison answers for every view of it: once per view grows with the square.
        if have.storage.key in crc_done:
            return True
        crc_done.add(have.storage.key)
        return _record_crc(out, have.storage.key) == record.crc32
    return tensor_digest(out, have) == tensor_digest(source, want)


def verify_output(path: str, expected: Expected, level: str = "sizes") -> str:
    """Check a written file against what was meant to be written.

    Args:
        path: the written file (usually still the temp file).
        expected: the tensors the output's selected state dict must hold.
        level: ``sizes`` (keys with their types, dtypes, shapes, strides, byte counts,
            sharing, the conjugate and negative view bits, in torch outputs also
            ``requires_grad``, ``nn.Parameter``-ness and, where ``expected`` maps them, the
            saved device tags; and for torch archives the layout ``torch.load`` needs: stored
            aligned records, small records' CRC-32s, ``data.pkl`` opcodes; see
            :func:`~ckpt_tools.io.verify.zipcheck.check_torch_zip`), ``full`` (also every tensor's
            bytes), or ``none``.

    Returns:
        What was checked, in words.

    Raises:
        VerificationError: the output does not read back as expected.
        OSError: reading tensor bytes failed (``full``).
    """
    if level == "none":
        return NOT_VERIFIED
    out, sd = _read_back(path, expected)
    kinds = (TensorRef, RebuiltTensor) if expected.rebuilt else TensorRef
    got = {k: v for k, v in sd.items() if isinstance(v, kinds)}
    got = as_planned_keys(got, expected.tensors, safetensors=out.format == "safetensors")
    _check_tensors(out, got, expected, level)
    if level == "full":
        return f"verified: {len(got)} tensors, keys, sizes and bytes"
    return f"verified: {len(got)} tensors, keys and sizes"


def _read_back(path: str, expected: Expected) -> tuple[Checkpoint, Mapping[Any, Any]]:
    """The written file opened with our readers, its layout checked as ``torch.load`` needs it
    (torch archives), and its selected state dict."""
    try:
        out = open_checkpoint(path)
        selection = select_state_dict(out.root, select=expected.select)
    except CheckpointError as e:
        raise VerificationError(f"the written file does not read back: {e}") from e
    # A root that is no mapping (torch.save(tensor)): its tensors by their places in it.
    sd = tensors_by_place(out.root) if selection.stand_in else selection.state_dict
    if out.format == "torch-zip":
        # Imported here: the zip checks load the pickle machinery a safetensors output
        # never needs, and a rewrite should not pay for it at startup.
        from ckpt_tools.io.verify.zipcheck import check_torch_zip

        check_torch_zip(path, out)  # laid out as torch.load reads it, not only as we read it
    # A rewrite carries globals through, never adds one: a global the input did not name
    # would be code the output runs (in torch.load(weights_only=False)) that nobody allowed.
    introduced = [g for g in out.unsafe_globals if g not in expected.source.unsafe_globals]
    if introduced:
        raise VerificationError(
            f"the written file names globals outside the allowlist that the input does not "
            f"({', '.join(introduced[:5])})"
        )
    return out, sd


def _check_tensors(out: Checkpoint, got: Mapping[Any, Any], expected: Expected, level: str) -> None:
    """Each written tensor as planned: dtype, shape, size and view bits; for torch outputs its
    view, flags, device and which tensors share its storage; at ``full`` its bytes and its
    record's CRC-32. A sparse or nested tensor: its own fields, then each of its parts so."""
    sharing_src: dict[int, str] = {}
    sharing_out: dict[int, str] = {}
    crc_done: set[str] = set()
    for name, want in expected.tensors.items():
        for label, have_t, want_t in _views(out, name, got[name], want, expected.devices):
            _check_view(out, label, have_t, want_t, expected.devices)
            first_src = sharing_src.setdefault(id(want_t.storage), label)
            first_out = sharing_out.setdefault(id(have_t.storage), label)
            if first_src != first_out and out.format != "safetensors":
                raise VerificationError(
                    f"{label} shares storage with {first_out} in the output but with "
                    f"{first_src} in the input"
                )
            if level == "full" and not _same_bytes(out, have_t, expected.source, want_t, crc_done):
                raise VerificationError(f"the bytes of {label} differ after writing")
            if level == "full" and first_out == label:
                _check_record_crc(out, have_t.storage.key)


def _views(
    out: Checkpoint, name: Any, have: Any, want: Any, devices: Mapping[str, str] | None
) -> list[tuple[str, TensorRef, TensorRef]]:
    """The storage views to compare for the tensor ``name``, each with its label: the tensor
    itself, or a sparse or nested tensor's parts once its own fields match."""
    if isinstance(want, TensorRef) and isinstance(have, TensorRef):
        return [(repr(name), have, want)]
    said = f"{want.layout} {want.dtype} {list(want.shape)}"
    if not isinstance(have, RebuiltTensor) or not isinstance(want, RebuiltTensor):
        raise VerificationError(f"{name!r} reads back as {type(have).__name__}, expected {said}")
    if (have.layout, have.dtype, have.shape, len(have.parts)) != (
        want.layout,
        want.dtype,
        want.shape,
        len(want.parts),
    ):
        raise VerificationError(
            f"{name!r} reads back as {have.layout} {have.dtype} {list(have.shape)}, expected {said}"
        )
    torch_output = out.format != "safetensors"
    _check_rebuilt_attributes(repr(name), have, want, torch_output=torch_output, devices=devices)
    return [(f"{name!r} (part {i})", h, w) for i, (h, w) in enumerate(zip(have.parts, want.parts))]


def _check_view(
    out: Checkpoint,
    label: str,
    have: TensorRef,
    want: TensorRef,
    devices: Mapping[str, str] | None = None,
) -> None:
    """One written view as planned: dtype, shape, size, view bits; in torch outputs its
    strides, storage offset, flags and device (safetensors stores each tensor contiguous,
    without flags)."""
    if (have.dtype, have.shape, have.nbytes) != (want.dtype, want.shape, want.nbytes):
        raise VerificationError(
            f"{label} reads back as {have.dtype} {list(have.shape)}, expected "
            f"{want.dtype} {list(want.shape)}"
        )
    if out.format != "safetensors" and (have.stride, have.offset) != (want.stride, want.offset):
        raise VerificationError(
            f"{label} reads back with strides {list(have.stride)} at storage offset "
            f"{have.offset}, expected {list(want.stride)} at {want.offset}"
        )
    _check_attributes(label, have, want, torch_output=out.format != "safetensors", devices=devices)


# What torch.load sets on a tensor besides its bytes and geometry (view bits, requires_grad,
# nn.Parameter-ness, the saved device tag), compared from the re-read pickle alone: no
# tensor byte is read for them, so every level that compares dtypes and shapes compares them.

_BIT_WORDS = {"conj": "conjugate", "neg": "negative"}


def _said(bits: frozenset[str]) -> str:
    """``{'conj', 'neg'}`` in words: ``a conjugate and negative view``; none: ``no view bit``."""
    if not bits:
        return "no view bit"
    return "a " + " and ".join(_BIT_WORDS[b] for b in sorted(bits)) + " view"


def _check_attributes(
    label: str,
    have: TensorRef,
    want: TensorRef,
    *,
    torch_output: bool,
    devices: Mapping[str, str] | None = None,
) -> None:
    """Refuse a written dense tensor that ``torch.load`` would rebuild otherwise than planned.

    The view bits are compared in every format: a lost conjugate or negative bit leaves the
    bytes and geometry as planned while ``torch.load`` returns other values. The rest only in
    torch outputs, which hold them (safetensors keeps neither gradients nor parameters).

    Args:
        label: the tensor's name as errors say it.
        have: the tensor as the output reads back.
        want: the tensor the plan meant to write.
        torch_output: the output is a torch archive.
        devices: saved device tag -> the tag the output holds for it (``{}``: every tag kept;
            None: tags not compared, for a caller that does not say how it mapped them).

    Raises:
        VerificationError: one line naming the tensor, what was planned and what was found.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> t = TensorRef(StorageRef("0", "float32", 2, "cpu"), 0, (2,), (1,), "float32")
        >>> _check_attributes("'w'", t, t, torch_output=True, devices={})
    """
    if have.view_bits != want.view_bits:
        raise VerificationError(
            f"{label} reads back as {_said(have.view_bits)}, expected {_said(want.view_bits)} "
            "(torch.load would give other values)"
        )
    if not torch_output:
        return
    if have.requires_grad != want.requires_grad:
        raise VerificationError(
            f"{label} reads back with requires_grad={have.requires_grad}, expected "
            f"requires_grad={want.requires_grad}"
        )
    if have.is_parameter != want.is_parameter:
        kind = {True: "an nn.Parameter", False: "a plain tensor"}
        raise VerificationError(
            f"{label} reads back as {kind[have.is_parameter]}, expected {kind[want.is_parameter]}"
        )
    _check_device(label, have.device, want.device, devices)


def _check_rebuilt_attributes(
    label: str,
    have: RebuiltTensor,
    want: RebuiltTensor,
    *,
    torch_output: bool,
    devices: Mapping[str, str] | None = None,
) -> None:
    """Refuse a written sparse, meta or nested tensor whose own fields differ from the plan's.

    Its layout, dtype, shape and part count are compared by the caller; this adds what the
    descriptor also carries: a meta tensor's strides, the element count, and the device.

    Args:
        label: the tensor's name as errors say it.
        have: the tensor as the output reads back.
        want: the tensor the plan meant to write.
        torch_output: the output is a torch archive (the only one that holds these).
        devices: as for :func:`_check_attributes`.

    Raises:
        VerificationError: one line naming the tensor, what was planned and what was found.
    """
    if not torch_output:
        return
    if (have.stride, have.numel) != (want.stride, want.numel):
        raise VerificationError(
            f"{label} reads back with strides {list(have.stride)} and {have.numel} elements, "
            f"expected {list(want.stride)} and {want.numel}"
        )
    _check_device(label, have.device, want.device, devices)


def _check_device(label: str, have: str, want: str, devices: Mapping[str, str] | None) -> None:
    """The saved device tag as planned, after the caller's mapping (a retag changes tags)."""
    if devices is None:
        return
    planned = devices.get(want, want)
    if have != planned:
        raise VerificationError(f"{label} reads back saved on {have!r}, expected {planned!r}")
