"""`dspark train all`: data -> features -> fit -> export -> eval in one command, each stage resumable."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from tqdm.auto import tqdm

from dspark.api import EngineConfig, build_engine
from dspark.cli.train_data import answer_prompts, generator, prompt_set
from dspark.cli.train_eval import print_eval
from dspark.cli.train_fit import report_fit, train_config
from dspark.train.e2e import engine_eval
from dspark.train.export import export_run, size_mb
from dspark.train.trainer import train


def all_stage(args) -> int:
    t0 = time.perf_counter()
    root = Path(args.out)
    data, held = root / "data" / "train.jsonl", root / "data" / "heldout.jsonl"
    model, tok, engine = generator(args)
    print("[1/4] self-distillation data")
    answer_prompts(model, tok, args, args.train_prompts, data, args.data_seed, engine)
    answer_prompts(model, tok, args, args.heldout_prompts, held, args.data_seed, engine)
    del model, engine  # the trainer loads its own copy
    print("[2/4] training" + (" (online features)" if args.online else " (features cached in bf16)"))
    cfg = train_config(
        args, str(data), str(held), "online" if args.online else str(root / "features"), str(root / "run")
    )
    res = train(cfg, progress=not args.quiet, echo=tqdm.write)
    report_fit(res)
    print("[3/4] export")
    # DeepSpec files are anchor-first and have no d2t: a reduced vocabulary is speculators-only
    deepspec_ok = args.layout == "anchor_first" and args.draft_vocab is None
    for fmt in ("speculators", "deepspec") if deepspec_ok else ("speculators",):
        dst = root / f"draft-{fmt}"
        shutil.rmtree(dst, ignore_errors=True)  # a rerun refreshes the exports from the latest checkpoint
        export_run(root / "run", dst, fmt, args.verifier)
        print(f"  {fmt}: {dst} ({size_mb(dst):.1f} MiB)")
    print("[4/4] engine check on held-out prompts")
    # as before this command had engine flags: no load-time check (training just measured the draft)
    engine = build_engine(
        EngineConfig(
            target=args.target, draft=str(root / "run" / "draft"), dtype=args.dtype, check=False, verify="full"
        )
    )
    prompts = prompt_set(args.heldout_prompts, None)[: args.eval_prompts]
    ev = engine_eval(
        engine,
        prompts,
        max_new_tokens=args.eval_max_new_tokens,
        chat_template=not args.no_chat_template,
        progress=not args.quiet,
    )
    (root / "engine_eval.json").write_text(json.dumps(ev, indent=2) + "\n")
    print_eval(ev, False)
    print(f"all stages done in {(time.perf_counter() - t0) / 60:.1f} min (this invocation)")
    return 0
