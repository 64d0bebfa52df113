"""``scan``: a security verdict for every checkpoint (see :mod:`.scanning`)."""

from ckpt_tools.ops.scan.report import FileScan, Finding, ScanReport
from ckpt_tools.ops.scan.scanning import scan, scan_file

__all__ = ["FileScan", "Finding", "ScanReport", "scan", "scan_file"]
