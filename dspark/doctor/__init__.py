"""The draft check behind `dspark doctor` and the engine's load-time check (library: no printing).

The silent failures of docs/DESIGN.md §9 all load, run and accept less than they should.
Reading the config cannot catch them; measuring can. The target writes text through the
engine's own plain (greedy) decoding; one target forward over that text gives its argmax and
its hidden states at every tap index needed. Each *reading* of the draft (the declared one;
the other block layout, keeping gamma or keeping block_size; hidden_state_indices shifted by
-1 and +1; other mask token ids) then runs through the draft's own block forward, the one
`propose` uses (`DSparkDraft.read_as` + `engine.drafting.teacher_forced`), at every anchor of that
text at once. Under
greedy decoding the leading proposals that equal the target's argmax are exactly what
verification accepts, so each reading gets L(i), the drafts accepted at anchor i, and its
acceptance length tau = 1 + mean L on this text; and, from the same block forward with the
Markov head fed the target's tokens, the log-probability the draft gives each of the target's
tokens (the objective it was trained on, under its true reading).

The verdict compares every alternative with the declared reading on the same anchors
(`dspark.bench.paired`): an alternative is *better* when it gives at least MIN_GAIN (3%) more
tokens per step, or LL_MIN_GAIN more log-probability per slot (a far less noisy statistic: it
sees a weak draft's shifted taps, which barely move acceptance), with a one-sided p below ALPHA
(0.01) shared by all alternatives and all looks (Bonferroni); *not better* when both gains are
excluded at the same level. It is sequential: while some alternative is open, the target
writes more text (rounds of doubling size, up to a token bound) and only the open readings
are measured again.

    misread    an alternative is better (exit 3): the file's keys to change and the numbers
    healthy    every alternative is excluded from being better on either statistic (exit 0)
    undecided  the bound was reached first (exit 4): the figures, never "healthy"

`quick_check(engine)` is the same statistic on a short sample, at load time.

The modules, one job each: `report` (settings, texts, readings, the report), `texts` (what the
target writes), `readings` (the alternatives and one reading's scores), `statistic` (paired
comparisons, the diagnosis), `static` (checks from the files alone), `check` (the sequential
check, `diagnose`), `quick` (the load-time check), `cache` (the load-time check's result, kept
per target, draft, runtime and machine).
"""
