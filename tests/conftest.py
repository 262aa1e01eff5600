import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tests run in parallel (one process per core): one thread each, or they fight.
torch.set_num_threads(1)

from tests.trained import trained  # noqa: E402,F401  (session fixture: a tiny trained target + draft)
