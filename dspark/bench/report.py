"""`dspark bench` outputs: the Markdown tables and the PNG plots, both read from results.json's dict."""

from __future__ import annotations

from pathlib import Path


def _f(x, fmt: str = "{:.2f}", none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def markdown(results: dict) -> str:
    cfg, mach = results["config"], results["machine"]
    base = cfg["baseline"]
    lines = [
        "# dspark bench",
        "",
        f"Target `{cfg['target']}` ({cfg['dtype']}, {mach['device']}), draft `{cfg['draft']}`; "
        f"{cfg['max_new_tokens']} new tokens max, temperature {cfg['temperature']}, "
        f"{'chat template' if cfg['chat'] else 'raw prompts'}, up to {cfg['limit']} prompts per set.",
        f"Machine: {mach['cpu']} ({mach['cpu_count']} cores, torch threads {mach['torch_threads']}), "
        f"load average {mach['load_average_start']} at start, {mach['load_average_end']} at end; "
        f"torch {mach['torch']}, transformers {mach['transformers']}.",
        "",
        "## Throughput",
        "",
        f"Ratio = tokens/s over `{base}` on the same prompts. Overhead = wall time minus target and draft "
        "forward passes (budget: under 10% for dspark arms). Same = share of prompts whose output equals the "
        "baseline's token for token (bf16 may flip near-ties, see docs/DESIGN.md §10). Lookup = the steps "
        "whose tokens the lookup proposer copied from the request's own text, and their acceptance length "
        "(bonus included); the draft's columns count the draft's blocks alone.",
        "",
        "| set | arm | tokens/s | ratio | mean acc. len | draft acc. rate | lookup | target | draft | overhead "
        "| same |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for set_name, arms in results["sets"].items():
        for arm in arms["arms"].values():
            acc = arm.get("acceptance") or {}
            tf = arm["time_fraction"]
            over = f"{100 * tf['overhead']:.1f}%"
            if arm["overhead_within_budget"] is False:
                over += " (over budget)"
            look = acc.get("lookup")
            looked = f"{look['verify_steps']} steps, {look['mean_accept_length']:.2f}" if look else "-"
            lines.append(
                f"| {set_name} | {arm['label']} | {arm['tokens_per_second']:.1f} | {_f(arm['ratio_to_baseline'])} | "
                f"{_f(acc.get('mean_accept_length'))} | {_f(acc.get('draft_acceptance_rate'), '{:.3f}')} | {looked} | "
                f"{100 * tf['target_forward']:.0f}% | {100 * tf['draft']:.0f}% | {over} | "
                f"{_f(arm['same_output_as_baseline'], '{:.0%}')} |"
            )
    prof_arm = results.get("profile_arm")
    if prof_arm:
        g = results["gamma"]
        lines += [
            "",
            f"## Acceptance per position (`{prof_arm}` arm)",
            "",
            "Conditional = P(slot i accepted | slots before it accepted); marginal = P(slots 1..i all accepted) "
            "per verify step. Mean acceptance length counts the bonus token: 1 + sum of marginals.",
            "",
            "| set | rate | " + " | ".join(str(i + 1) for i in range(g)) + " | mean acc. len |",
            "|---|---|" + "---:|" * g + "---:|",
        ]
        for set_name, arms in results["sets"].items():
            acc = (arms["arms"].get(prof_arm) or {}).get("acceptance")
            if not acc:
                continue
            for kind in ("conditional", "marginal"):
                vals = " | ".join(f"{x:.2f}" for x in acc[f"{kind}_accept_rates"])
                lines.append(f"| {set_name} | {kind} | {vals} | {acc['mean_accept_length']:.2f} |")
    lines += [
        "",
        "## Time breakdown (seconds)",
        "",
        "| set | arm | wall | target forward | draft | overhead | engine verify span | engine other span |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for set_name, arms in results["sets"].items():
        for arm in arms["arms"].values():
            t = arm["time_s"]
            lines.append(
                f"| {set_name} | {arm['label']} | {t['wall']:.2f} | {t['target_forward']:.2f} | "
                f"{t['draft']:.2f} | {t['overhead']:.2f} | {t['engine_verify_span']:.2f} | "
                f"{t['engine_other_span']:.2f} |"
            )
    if results.get("runtimes"):
        lines += ["", "## Target runtimes (plain decoding, batch 1, arms alternated)", "", results["runtimes"]["table"]]
    lines += ["", f"Reproduce: `{results['command']}`", ""]
    return "\n".join(lines)


def plots(results: dict, out: Path) -> list[Path]:
    # Imported here, on purpose: the backend must be chosen before pyplot loads, and choosing it is
    # process-wide; only a command that writes plots should make that choice (and pay the import).
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt

    written: list[Path] = []
    sets = [s for s in results["sets"] if s != "all"]
    prof_arm = results.get("profile_arm")
    if prof_arm:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for set_name in sets:
            acc = (results["sets"][set_name]["arms"].get(prof_arm) or {}).get("acceptance")
            if not acc:
                continue
            pos = range(1, len(acc["conditional_accept_rates"]) + 1)
            axes[0].plot(pos, acc["conditional_accept_rates"], marker="o", label=set_name)
            axes[1].plot(
                pos, acc["marginal_accept_rates"], marker="o", label=f"{set_name} (tau {acc['mean_accept_length']:.2f})"
            )
            for ax in axes:
                ax.set_xticks(list(pos))
        axes[0].set_title("conditional: P(slot i | slots < i accepted)")
        axes[1].set_title("marginal: P(slots 1..i all accepted)")
        for ax in axes:
            ax.set_xlabel("draft position")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("acceptance rate")
        axes[1].legend(fontsize=8)
        fig.suptitle(f"Acceptance per position ({prof_arm} arm)")
        fig.tight_layout()
        p = out / "acceptance_per_position.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    arm_names = list(next(iter(results["sets"].values()))["arms"])
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(sets) * max(1, len(arm_names)) / 3), 4))
    width = 0.8 / max(1, len(arm_names))
    for j, name in enumerate(arm_names):
        ratios = [results["sets"][s]["arms"][name]["ratio_to_baseline"] or 0.0 for s in [*sets, "all"]]
        label = results["sets"]["all"]["arms"][name]["label"]
        ax.bar([i + (j - (len(arm_names) - 1) / 2) * width for i in range(len(ratios))], ratios, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(sets) + 1), [*sets, "all"])
    ax.set_ylabel(f"tokens/s ratio to {results['config']['baseline']}")
    ax.set_title("Speedup per prompt set and arm")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    p = out / "speedup.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    return written
