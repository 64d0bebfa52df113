"""Where a numpy ``.npy`` array's pickle starts: ``numpy.load(allow_pickle=True)`` unpickles
what follows the header of an array whose dtype holds Python objects. Read as numpy reads
the header, so that a scan walks every pickle numpy would run."""

from __future__ import annotations

import ast
import re

__all__ = ["NPY_MAGIC", "npy_pickle_offset"]

#: How every ``.npy`` file starts (``numpy.lib.format.MAGIC_PREFIX``).
NPY_MAGIC = b"\x93NUMPY"


def npy_pickle_offset(head: bytes) -> int | None:
    """Where the pickle of a numpy ``.npy`` array of objects starts, from the file's first
    bytes (``numpy.load`` with ``allow_pickle=True`` unpickles what follows the header,
    whatever its first byte); None for anything else.

    Where the header runs past ``head`` its dtype is not known, and the offset is given:
    a walk from there tells.

    Example:
        >>> import io, numpy as np
        >>> buf = io.BytesIO(); np.save(buf, np.array([{}], dtype=object), allow_pickle=True)
        >>> buf.getvalue()[npy_pickle_offset(buf.getvalue())]
        128
        >>> buf = io.BytesIO(); np.save(buf, np.zeros(3)); npy_pickle_offset(buf.getvalue())
    """
    if not head.startswith(NPY_MAGIC) or len(head) < 12:
        return None
    # Format 1.0 gives the header's length in 2 bytes, 2.0 and 3.0 in 4.
    width = 2 if head[6] == 1 else 4
    start = 8 + width + int.from_bytes(head[8 : 8 + width], "little")
    if start > len(head):
        return start
    text = head[8 + width : start].decode("latin-1")
    try:
        try:
            header = ast.literal_eval(text)
        except (ValueError, SyntaxError):  # numpy first drops Python 2's long suffix: (1L,)
            header = ast.literal_eval(_PY2_LONG.sub(r"\1", text))
        descr = header["descr"]
    except (ValueError, SyntaxError, TypeError, KeyError, MemoryError, RecursionError):
        return start  # a header read otherwise than numpy reads it: what follows is walked
    return start if _holds_objects(descr) else None


_PY2_LONG = re.compile(r"\b(\d+)[lL]\b")


def _holds_objects(descr: object) -> bool:
    """Whether numpy reads the ``.npy`` header's ``descr`` as a dtype that holds Python
    objects (``numpy.lib.format.descr_to_dtype``): a string naming the object type, a
    subarray ``(descr, shape)`` of one, or a structured list with such a field. A shape
    numpy would not take is no array numpy loads; any other is taken to hold objects."""
    if isinstance(descr, str):
        # ("O", "object_", and inside a comma list or a repeat: "i8,O", "(2,)O", "2O".) No
        # other type code or name numpy reads holds an upper-case O.
        return "O" in descr or "object" in descr
    if isinstance(descr, tuple):
        return bool(descr) and _holds_objects(descr[0])
    if isinstance(descr, list):
        return any(
            _holds_objects(field[1]) if isinstance(field, tuple) and len(field) in (2, 3) else True
            for field in descr
        )
    return True
