"""`dspark train eval`: greedy decoding through the engine, with and without the draft."""

from __future__ import annotations

import json
from dataclasses import replace

from dspark.api import build_engine
from dspark.cli.engine_flags import engine_config, no_draft_flag, print_notes
from dspark.cli.train_data import prompt_set
from dspark.train.e2e import engine_eval
from dspark.train.errors import TrainError


def print_eval(res: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(res, indent=2))
        return
    print(
        f"engine check on {res['prompts']} prompts (greedy): mean acceptance length {res['mean_accept_length']:.3f}, "
        f"speedup {res['speedup']:.2f}x ({res['spec_tok_s']:.1f} vs {res['plain_tok_s']:.1f} tok/s), "
        f"outputs equal to plain decoding: {res['outputs_equal_plain']}/{res['prompts']}"
    )
    print("  conditional acceptance per slot: " + " ".join(f"{x:.2f}" for x in res["conditional_accept"]))
    print("  marginal acceptance per slot:    " + " ".join(f"{x:.2f}" for x in res["marginal_accept"]))


def eval_stage(args) -> int:
    if flag := no_draft_flag(args):
        raise TrainError(f"train eval compares a draft with plain decoding: drop {flag}")
    # it measures the draft: every step drafts and verifies every slot unless --verify says otherwise
    # (adaptive would skip drafting a draft that does not pay, and report acceptance of nothing)
    engine = build_engine(replace(engine_config(args), verify=args.verify or "full"))
    print_notes(engine)
    res = engine_eval(
        engine,
        prompt_set(args.prompts, args.limit),
        max_new_tokens=args.max_new_tokens,
        chat_template=not args.no_chat_template,
        progress=not args.quiet,
    )
    print_eval(res, args.json)
    return 0
