"""The prompts of a prompt set that no packed data set answers yet, for the next data round.

    python scripts/unanswered_prompts.py data/smollm2/magpie-prompts-v1.jsonl.gz \
        data/smollm2/selfdistill-v1 data/smollm2/selfdistill-v2 --out PROMPTS.jsonl [--seed 23]

A packed data set keeps each answer's prompt key (`keys` in tokens.npz; a sampled answer k > 0 is
keyed "<prompt key>#k"), the key `dspark train data` resumes and deduplicates by; a prompt whose
key is there is answered. The rest are written shuffled (seeded), one JSON object a line with its
category, so that a round stopped early still covers the categories evenly. Then:

    dspark train data --target smollm2 --prompts PROMPTS.jsonl --out SHARD.jsonl --temperature 0.7 \
        --top-p 0.8 --top-k 20 --seed S --max-new-tokens 512 --gen-batch-size 16
    dspark train pack --target smollm2 --out data/smollm2/selfdistill-vN SHARD.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from dspark.train.dataset import read_packed
from dspark.train.prompts import load_prompts


def answered_keys(data_dirs: list[Path]) -> set[str]:
    """The prompt keys the packed sets answer (each set checked against its manifest)."""
    return {r["key"].split("#")[0] for d in data_dirs for r in read_packed(d)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("prompts", help="a prompt set (.jsonl / .jsonl.gz / .txt)")
    ap.add_argument("data", nargs="+", type=Path, help="packed data sets whose prompts are answered")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=23)
    args = ap.parse_args()
    done = answered_keys(args.data)
    todo = [p for p in load_prompts(args.prompts) if p.key not in done]
    random.Random(args.seed).shuffle(todo)
    with open(args.out, "w") as f:
        for p in todo:
            f.write(json.dumps({"prompt": p.text, "category": p.category}) + "\n")
    print(f"{len(todo)} prompts not answered yet (of those in {args.prompts}; {len(done)} answered) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
