"""DeepSeek-V4 bundled DSpark drafts: `dspark_*` keys inside the target's own config and
the draft weights under `mtp.*` (docs/DESIGN.md §3).

Recognized so that users get a precise refusal instead of a misread: the draft layers are
MoE blocks with hyper-connections and MLA attention, which dspark's backbone does not build.
"""

from __future__ import annotations

from dspark.errors import FormatError
from dspark.formats.spec import DraftSpec, FormatName

FORMAT: FormatName = "deepseek_v4"
KEYS = ("dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank", "dspark_noise_token_id")


def detect(config: dict) -> bool:
    return any(isinstance(k, str) and k.startswith("dspark_") for k in config)


def read(config: dict, weights_meta) -> DraftSpec:
    found = ", ".join(f"{k}={config[k]!r}" for k in KEYS if k in config) or "dspark_* keys"
    del weights_meta  # refused from the config alone: the bundled target is far too large to scan
    unsupported = [
        "MoE draft layers (n_routed_experts)",
        "hyper-connections (hc_mult)",
        "MLA attention",
        "mtp.* draft weights inside the target checkpoint",
    ]
    raise FormatError(
        f"DeepSeek-V4 bundled DSpark draft ({found}) is not supported: its draft uses "
        + ", ".join(unsupported)
        + "; serve it with an engine that runs DeepSeek-V4 MTP/DSpark natively"
    )
