"""Targets: thin adapters over Hugging Face causal LMs."""
