"""Decoding: proposal, verification, commit, metrics. Nothing about HTTP."""
