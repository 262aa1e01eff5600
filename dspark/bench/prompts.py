"""Prompt sets for `dspark bench`.

- The paper's evaluation sets, read from a directory (`--dataset-dir`): one JSONL file per set,
  `{"turns": ["first user message", ...]}` a line; the first turn is the prompt.
- The project's own held-out chat prompts (`dspark/assets/prompts/heldout.jsonl`, never trained
  on), named `chat`.
- The project's own copy-heavy tasks (`dspark/assets/prompts/copy.jsonl`: editing, code changes,
  format conversion, quoting, continuing a list; written for measuring the lookup proposer,
  never trained on), named `copy`.
- Any user file (`--prompts FILE`): JSONL with `turns` or `prompt`, or plain text one prompt a line;
  the set is named after the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dspark.errors import DSparkError
from dspark.prompts import read_prompt_file

PAPER_SETS = ("gsm8k", "math500", "aime25", "humaneval", "mbpp")
CHAT = "chat"
COPY = "copy"


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: tuple[str | list[int], ...]  # text, or token ids (a `prompt_ids` record)
    source: str


def heldout_path() -> Path:
    return Path(str(resources.files("dspark") / "assets" / "prompts" / "heldout.jsonl"))


def copy_path() -> Path:
    return Path(str(resources.files("dspark") / "assets" / "prompts" / "copy.jsonl"))


def load_sets(
    dataset_dir: str | None,
    sets: list[str] | None,
    prompt_files: list[str],
    limit: int | None,
) -> list[PromptSet]:
    """The prompt sets a bench run measures, in a stable order.

    sets None: every paper set present in dataset_dir, then `chat`, then the --prompts files (`copy`
    only when named).
    A set named explicitly but missing is an error (a silently smaller benchmark misleads).
    """
    wanted = list(sets) if sets else None
    available: dict[str, Path] = {}
    if dataset_dir is not None:
        d = Path(dataset_dir)
        if not d.is_dir():
            raise DSparkError(f"--dataset-dir {d} is not a directory")
        for name in PAPER_SETS:
            if (d / f"{name}.jsonl").is_file():
                available[name] = d / f"{name}.jsonl"
        for extra in sorted(d.glob("*.jsonl")):
            available.setdefault(extra.stem, extra)
    available[CHAT] = heldout_path()
    available[COPY] = copy_path()
    for f in prompt_files:
        p = Path(f)
        if p.stem in available and p != available[p.stem]:
            raise DSparkError(f"--prompts {p}: a prompt set named {p.stem!r} already exists; rename the file")
        available[p.stem] = p
    if wanted is None:
        wanted = [n for n in PAPER_SETS if n in available] + [CHAT] + [Path(f).stem for f in prompt_files]
        wanted = list(dict.fromkeys(wanted))
    missing = [n for n in wanted if n not in available]
    if missing:
        where = f"in {dataset_dir}" if dataset_dir else "(no --dataset-dir given)"
        raise DSparkError(f"prompt sets {missing} not found {where}; available: {sorted(available)}")
    return [PromptSet(n, tuple(read_prompt_file(available[n], limit)), str(available[n])) for n in wanted]
