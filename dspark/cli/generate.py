"""`dspark generate`: one prompt through the engine, text streamed as it is committed.

With --compare the same prompt is also decoded without speculation (same target, same code
path) and the speedup is printed: measured side by side in one run.
"""

from __future__ import annotations

import json
import sys
import time

LAYOUTS = ("anchor_first", "bonus_anchor")


def add_engine_arguments(p) -> None:
    """Flags shared by every command that builds an engine (generate, serve, bench, doctor)."""
    p.add_argument("--target", default="smollm2", help="HF model directory, or 'smollm2' (default)")
    p.add_argument("--draft", default=None, help="draft checkpoint directory (default: the bundled draft for smollm2)")
    p.add_argument("--no-spec", action="store_true", help="plain target decoding through the same code path")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="target and draft dtype")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="force a block layout against the file (experts and diagnosis; warns loudly)")
    p.add_argument("--verify", choices=["full", "threshold", "adaptive"], default="full",
                   help="verification policy (default full)")
    p.add_argument("--threshold", type=float, default=0.5, help="confidence cut for --verify threshold")
    p.add_argument("--calibration", default=None, help="STS file written by `dspark calibrate`")
    p.add_argument("--always-draft", action="store_true",
                   help="--verify adaptive: draft every step, even when earlier steps say it does not pay")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-check", action="store_true", help="skip the draft check at load time (a short doctor run)")


def add_generate_arguments(p) -> None:
    add_engine_arguments(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the target's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout: text and all metrics")
    p.add_argument("--compare", action="store_true", help="also decode without speculation and print the speedup")


def build_engine(args, **engine_options):
    """The engine that add_engine_arguments' flags describe (generate, serve, ...)."""
    from dspark.api import load_engine

    engine = load_engine(args.target, args.draft, no_spec=args.no_spec, dtype=args.dtype, device=args.device,
                         layout=args.layout, threads=args.threads, check=not args.no_check, **engine_options)
    if args.verify != "full":
        from dspark.engine.scheduler import make_scheduler

        engine.scheduler = make_scheduler(args.verify, engine, threshold=args.threshold, calibration=args.calibration,
                                          skip=not args.always_draft)
    return engine


def _streamer(engine):
    printed = [0]

    def on_tokens(req, _new):
        text = engine.decode(req.output_ids)
        if req.finished and req.text is not None:
            text = req.text
        # hold back a trailing replacement char: a multi-byte character is still incomplete
        safe = len(text) if req.finished else len(text.rstrip("\ufffd"))
        if safe > printed[0]:
            sys.stdout.write(text[printed[0]:safe])
            sys.stdout.flush()
            printed[0] = safe

    return on_tokens


def run_generate(args) -> int:
    from dspark.engine.engine import Engine
    from dspark.engine.sampling import SamplingParams

    engine = build_engine(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    ids = engine.encode(args.prompt, chat=args.chat)
    t0 = time.perf_counter()
    req = engine.generate(ids, params, on_tokens=None if args.json else _streamer(engine))
    elapsed = time.perf_counter() - t0
    out = {
        "text": req.text if req.text is not None else engine.decode(req.output_ids),
        "prompt_tokens": len(ids),
        "generated_tokens": len(req.output_ids),
        "finish_reason": req.finish_reason,
        "seconds": round(elapsed, 4),
        "tokens_per_second": round(len(req.output_ids) / elapsed, 2),
        "speculative": engine.draft is not None,
        "dtype": args.dtype,
    }
    if engine.draft is not None:
        out["layout"] = engine.draft.spec.layout
        out["metrics"] = req.metrics.to_dict()
    if args.compare and engine.draft is not None:
        plain = Engine(engine.target.__class__(engine.target.model), None, engine.tokenizer, engine.eos_token_ids)
        t0 = time.perf_counter()
        base = plain.generate(ids, params)
        base_s = time.perf_counter() - t0
        out["plain"] = {"generated_tokens": len(base.output_ids), "seconds": round(base_s, 4),
                        "tokens_per_second": round(len(base.output_ids) / base_s, 2),
                        "same_output": base.output_ids == req.output_ids}
        if not out["plain"]["same_output"] and params.greedy:
            out["plain"]["first_difference"] = _first_difference(engine.target.model, ids, req.output_ids,
                                                                 base.output_ids)
        out["speedup"] = round(out["tokens_per_second"] / out["plain"]["tokens_per_second"], 3)
    if args.json:
        print(json.dumps(out))
    else:
        print()
        _print_summary(out)
    return 0


def _first_difference(model, prompt: list[int], spec: list[int], plain: list[int]) -> dict:
    """Where two greedy outputs part, and by how much the target's own logits separate the two
    choices there (one fresh forward of the shared prefix). A gap of a few hundredths in bf16 is
    a near-tie that the verify block and the one-token step rounded differently (spec sheet,
    section 10); a large gap would be a bug."""
    import torch

    n = min(len(spec), len(plain))
    k = next((i for i in range(n) if spec[i] != plain[i]), n)
    if k == n:  # one output is a prefix of the other (a stop token near a tie)
        return {"token": k, "logit_gap": None}
    ids = torch.tensor([prompt + plain[:k]], device=model.device)
    with torch.inference_mode():
        logits = model(ids).logits[0, -1].float()
    return {"token": k, "logit_gap": round(abs(float(logits[spec[k]] - logits[plain[k]])), 4)}


def _print_summary(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=False)
    t = Table(title="dspark generate", show_header=False)
    t.add_row("generated tokens", str(out["generated_tokens"]))
    t.add_row("tokens/s", f"{out['tokens_per_second']:.1f}")
    m = out.get("metrics")
    if m:
        t.add_row("layout", out["layout"])
        t.add_row("verify steps", str(m["verify_steps"]))
        t.add_row("mean acceptance length", f"{m['mean_accept_length']:.2f}  (tokens per verify step, bonus included)")
        t.add_row("draft acceptance rate", f"{m['draft_acceptance_rate']:.3f}  (accepted / verified drafts)")
        t.add_row("conditional acceptance", " ".join(f"{x:.2f}" for x in m["conditional_accept_rates"]))
        t.add_row("marginal acceptance", " ".join(f"{x:.2f}" for x in m["marginal_accept_rates"]))
        ts = m["time_s"]
        tot = ts["total"] or 1.0
        t.add_row("time split", f"draft {ts['draft'] / tot:.0%}  verify {ts['verify'] / tot:.0%}  other {ts['other'] / tot:.0%}")
    if "plain" in out:
        t.add_row("plain decoding tokens/s", f"{out['plain']['tokens_per_second']:.1f}")
        t.add_row("speedup over plain decoding", f"{out['speedup']:.2f}x")
        same, diff = out["plain"]["same_output"], out["plain"].get("first_difference")
        if not same and diff and diff["logit_gap"] is not None:
            same = (f"no: from token {diff['token']}, where the target's two candidates are "
                    f"{diff['logit_gap']:.3f} logits apart (a {out.get('dtype', 'low-precision')} near-tie)")
        t.add_row("same output as plain", str(same))
    console.print(t)
