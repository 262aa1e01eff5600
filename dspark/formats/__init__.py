"""Checkpoint formats: every DSpark draft family read into one DraftSpec."""
