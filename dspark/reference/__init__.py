"""Reference implementations: what the compiled paths are tested against, never what decodes.

Each module here re-runs a compiled path step by step in Python, over the same kernels in the
same order, so that a test can compare the two bit for bit and name the step that differs. No
module of dspark outside this package imports it (tests/test_structure.py): the decoding code
has one implementation per layer, the compiled one on a CPU with dspark's kernels and torch's
ops elsewhere (dspark/target/torch_layers.py).

- kernel_loop: the target's decoder layers as a Python loop over the extension's kernels, the
  loop csrc/layers.cpp runs in one call.
"""
