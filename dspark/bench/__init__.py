"""Measurement tools: `dspark bench` (arms side by side), the speculation profile, `dspark doctor`."""
