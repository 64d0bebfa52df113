"""Parity: every strategy trained with the same seed and batches, then checked against single-device
training on the files it wrote (read the plain way, with torch.load), and plotted.
"""
