"""Measurement tools behind `dspark bench` (arms side by side), `dspark bench-batch`, the speculation
profile and `dspark doctor`; their flags and printing live in dspark/cli."""
