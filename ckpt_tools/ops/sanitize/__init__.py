"""``sanitize``: a checkpoint rebuilt with only the data it needs, every pickle replaced by a
plain one.
"""
