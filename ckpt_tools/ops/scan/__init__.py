"""``scan``: a security verdict for every checkpoint (see :mod:`.scanning`).

torch-free: a pickle's imports are walked and judged by name, never executed, so scanning
a hostile file is safe.
"""

from ckpt_tools.ops.scan.report import FileScan, Finding, ScanReport
from ckpt_tools.ops.scan.scanning import scan, scan_file

__all__ = ["FileScan", "Finding", "ScanReport", "scan", "scan_file"]
