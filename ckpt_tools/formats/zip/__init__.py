"""Zip archives as torch reads them: the central directory, record lookup and the torch zip
reader.

torch-free: an archive is accepted or refused as torch's own reader (miniz) decides, so a
file we open is one ``torch.load`` opens too.
"""
