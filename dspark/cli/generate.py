"""`dspark generate`: one prompt through the engine, text streamed as it is committed.

With --compare the same prompt is also decoded without speculation (same target, same code
path) and the speedup is printed: measured side by side in one run. The streamed run is what the
user reads; the measured rounds come after it, both arms warmed up, the two requests advancing one
engine step each in turn (`dspark.bench.runner.side_by_side`), so a slow moment of a shared
machine falls on both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dspark.api import build_engine
from dspark.bench.runner import side_by_side
from dspark.cli.engine_flags import add_engine_flags, engine_config, print_notes
from dspark.engine.compare import first_difference
from dspark.engine.marks import KINDS, TextPieces, counts
from dspark.engine.sampling import SamplingParams
from dspark.errors import DSparkError

# the page's colours (dspark/serve/static/page.css) in the 8 standard terminal colours, which every
# colour terminal shows (rich would fold the page's pale shades into one on such a terminal)
MARK_STYLE = {
    "accepted": "black on green",
    "lookup": "black on yellow",
    "corrected": "white on red",
    "bonus": "black on cyan",
    "plain": "",
}
MARK_LEGEND = {
    "accepted": "drafted, accepted",
    "lookup": "copied from the text (lookup), accepted",
    "corrected": "corrected by the target",
    "bonus": "the target's bonus",
    "plain": "plain step",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the target's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout: text and all metrics")
    p.add_argument(
        "--show-drafts",
        action="store_true",
        help="mark each token by origin: drafted and accepted, copied from the prompt or output (lookup) and "
        "accepted, corrected by the target, the target's bonus token, or a plain step (colours in a terminal; "
        "--json: a `tokens` list)",
    )
    p.add_argument("--compare", action="store_true", help="also decode without speculation and print the speedup")
    p.add_argument(
        "--compare-rounds",
        type=int,
        default=3,
        help="--compare: measured rounds after a warm-up of both arms; in each, the two arms decode "
        "side by side, one step each in turn, which arm steps first alternating",
    )


def _streamer():
    """on_tokens callback: print what the request's text gained (the engine's own detokenizer)."""
    printed = [0]

    def on_tokens(req, _new):
        text = req.stream_text()
        if len(text) > printed[0]:
            sys.stdout.write(text[printed[0] :])
            sys.stdout.flush()
            printed[0] = len(text)

    return on_tokens


def _mark_streamer(console: Console):
    """on_tokens callback of --show-drafts: each new token's text in its kind's colour (rich
    drops the colours when stdout is not a terminal). Its `finish(req)` prints the rest once the
    request is done (cut at a stop string)."""
    pieces = TextPieces()

    def show(req):
        for m in pieces.take(req):
            console.print(Text(m.text, style=MARK_STYLE[m.kind]), end="", soft_wrap=True)

    def on_tokens(req, _new):
        if not req.finished:
            show(req)

    on_tokens.finish = show  # type: ignore[attr-defined]  # a function attribute: the callback's second entry point
    return on_tokens


def _timed(engine, ids, params, on_tokens=None, marks: bool = False):
    t0 = time.perf_counter()
    req = engine.generate(ids, params, on_tokens=on_tokens, marks=marks)
    return req, time.perf_counter() - t0


def run(args) -> int:
    if args.compare_rounds < 1:
        raise DSparkError(f"--compare-rounds must be >= 1, got {args.compare_rounds}")
    engine = build_engine(engine_config(args))
    print_notes(engine)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    ids = engine.encode(args.prompt, chat=args.chat)
    speculative = engine.speculative  # the draft's or the lookup's proposals (--no-draft: the lookup's alone)
    compare = args.compare and speculative
    plain = engine.derive(speculative=False) if compare else None
    if plain is not None:  # compare: both arms warmed up (allocator, kernels, caches) before anything is timed
        warm = SamplingParams(
            max_new_tokens=min(16, args.max_new_tokens),
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
        engine.generate(ids, warm)
        plain.generate(ids, warm)
    console = Console(highlight=False)
    stream = None if args.json else (_mark_streamer(console) if args.show_drafts else _streamer())
    req, elapsed = _timed(engine, ids, params, stream, marks=args.show_drafts)
    if args.show_drafts and stream is not None:
        stream.finish(req)
    out = {
        "text": req.text if req.text is not None else engine.decode(req.output_ids),
        "prompt_tokens": len(ids),
        "generated_tokens": len(req.output_ids),
        "finish_reason": req.finish_reason,
        "seconds": round(elapsed, 4),
        "tokens_per_second": round(len(req.output_ids) / elapsed, 2),
        "speculative": speculative,
        "dtype": engine.config.dtype,
    }
    if engine.draft is not None:
        out["layout"] = engine.draft.spec.layout
    if speculative:
        out["metrics"] = req.metrics.to_dict()
    if args.show_drafts:
        out["token_kinds"] = counts(req.marks)
        if args.json:
            out["tokens"] = [m.to_dict() for m in TextPieces().take(req)]
    if compare:
        # the streamed run above is not timed against plain (streaming costs what plain does not pay)
        spec_tok = spec_s = plain_tok = base_s = 0
        base, rounds, drafted, steps = None, [], 0, 0
        for r in range(args.compare_rounds):
            (s_req, p_req), (s_secs, p_secs), _ = side_by_side([engine, plain], ids, params, first=r)
            m = s_req.metrics.to_dict()
            looked = m["lookup"]["verify_steps"] if "lookup" in m else 0
            drafted += m["verify_steps"] + looked  # steps that verified proposals, the draft's or the lookup's
            steps += m["verify_steps"] + m["plain_steps"] + looked
            spec_tok, spec_s = spec_tok + len(s_req.output_ids), spec_s + s_secs
            plain_tok, base_s = plain_tok + len(p_req.output_ids), base_s + p_secs
            base = p_req if base is None else base  # the plain output compared with the streamed one
            rounds.append(round((len(s_req.output_ids) / s_secs) / (len(p_req.output_ids) / p_secs), 3))
        assert base is not None  # compare_rounds >= 1: a round ran
        out["tokens_per_second"] = round(spec_tok / spec_s, 2)
        out["compare_rounds"] = args.compare_rounds
        # each round's own ratio: their spread is the noise the overall figure carries
        out["speedup_rounds"] = rounds
        out["plain"] = {
            "generated_tokens": len(base.output_ids),
            "seconds": round(base_s, 4),
            "tokens_per_second": round(plain_tok / base_s, 2),
            "same_output": base.output_ids == req.output_ids,
            "sampled": not params.greedy,  # then the arms' draws differ, not their distribution
        }
        if not out["plain"]["same_output"] and params.greedy:
            out["plain"]["first_difference"] = first_difference(
                engine.target.model, ids, req.output_ids, base.output_ids
            )
        ratio = round(out["tokens_per_second"] / out["plain"]["tokens_per_second"], 3)
        # the timed rounds' own steps: the streamed run above may have drafted where they did not
        out["drafted_steps"], out["timed_steps"] = drafted, steps
        # no step drafted: both arms ran the same plain steps, so their ratio is the host's noise, not a speedup
        out["speedup"] = ratio if drafted else None
        out["arms_ratio"] = ratio
    if args.json:
        print(json.dumps(out))
    else:
        print()
        _print_summary(out)
    return 0


def _print_summary(out: dict) -> None:
    console = Console(stderr=False)
    t = Table(title="dspark generate", show_header=False)
    t.add_row("generated tokens", str(out["generated_tokens"]))
    t.add_row("tokens/s", f"{out['tokens_per_second']:.1f}")
    kinds = out.get("token_kinds")
    if kinds:
        cell = Text()
        for k in KINDS:
            cell.append(MARK_LEGEND[k], style=MARK_STYLE[k])
            cell.append(f" {kinds[k]}  ")
        t.add_row("tokens by origin", cell)
    m = out.get("metrics")
    if m:
        drafts = "layout" in out  # a draft ran (--no-draft: the lookup alone)
        if drafts:
            t.add_row("layout", out["layout"])
            t.add_row("verify steps", str(m["verify_steps"]))
        if m["plain_steps"]:
            what, why = (
                ("steps without drafting", "the policy judged that drafting would not pay")
                if drafts
                else ("steps without proposals", "the text offered no proposal that would pay")
            )
            t.add_row(what, f"{m['plain_steps']}  ({why})")
        if m["verify_steps"]:
            t.add_row(
                "mean acceptance length", f"{m['mean_accept_length']:.2f}  (tokens per verify step, bonus included)"
            )
            t.add_row("draft acceptance rate", f"{m['draft_acceptance_rate']:.3f}  (accepted / verified drafts)")
            t.add_row("conditional acceptance", " ".join(f"{x:.2f}" for x in m["conditional_accept_rates"]))
            t.add_row("marginal acceptance", " ".join(f"{x:.2f}" for x in m["marginal_accept_rates"]))
        look = m.get("lookup")
        if look is not None:
            t.add_row("lookup verify steps", f"{look['verify_steps']}  (proposals copied from the prompt or output)")
            if look["verify_steps"]:
                t.add_row(
                    "lookup acceptance length",
                    f"{look['mean_accept_length']:.2f}  ({look['accepted_tokens']} of {look['verified_tokens']} "
                    "verified lookup tokens accepted)",
                )
                t.add_row("lookup conditional", " ".join(f"{x:.2f}" for x in look["conditional_accept_rates"]))
        ts = m["time_s"]
        tot = ts["total"] or 1.0
        t.add_row(
            "time split",
            f"draft {ts['draft'] / tot:.0%}  verify {ts['verify'] / tot:.0%}  other {ts['other'] / tot:.0%}",
        )
    if "plain" in out:
        t.add_row("plain decoding tokens/s", f"{out['plain']['tokens_per_second']:.1f}")
        spread = out.get("speedup_rounds") or []
        rounds = f"  (rounds {min(spread):.2f}-{max(spread):.2f}x)" if len(spread) > 1 else ""
        timed = (
            f"{out['drafted_steps']} of {out['timed_steps']} steps verified proposals ({out['compare_rounds']} rounds)"
        )
        if out["speedup"] is None:
            t.add_row("speedup over plain decoding", f"none: the timed rounds drafted no step ({timed})")
            t.add_row("the two arms", "both decoded plainly in the timed rounds, the same steps")
            t.add_row("their ratio (noise)", f"{out['arms_ratio']:.2f}x{rounds}")
        else:
            t.add_row("speedup over plain decoding", f"{out['speedup']:.2f}x{rounds}")
            t.add_row("timed rounds", timed)
        same, diff = out["plain"]["same_output"], out["plain"].get("first_difference")
        if not same and diff and diff["logit_gap"] is not None:
            same = (
                f"no: from token {diff['token']}, where the target's two candidates are "
                f"{diff['logit_gap']:.3f} logits apart (a {out.get('dtype', 'low-precision')} near-tie)"
            )
        if not same and out["plain"].get("sampled"):
            # sampled arms draw by different uniforms: the same distribution, other draws
            same = "not compared (sampled: other draws)"
        t.add_row("same output as plain", str(same))
    console.print(t)
