"""The Python API: one EngineConfig -> build_engine(config), the only place where a target, a
draft, a verification policy and a tokenizer are put together.

    from dspark.api import EngineConfig, build_engine
    from dspark.engine.sampling import SamplingParams
    eng = build_engine(EngineConfig(target="smollm2"))       # bundled draft, bf16
    req = eng.generate(eng.encode("Hi!", chat=True), SamplingParams(max_new_tokens=64))
    print(req.text, req.metrics.to_dict())

Every command that decodes builds its engine here from the same flags (dspark.cli.engine_flags);
arms of a benchmark are `engine.derive(...)` of the one engine built, so nothing loads twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dspark import kernels
from dspark.doctor.cache import load_time_check
from dspark.engine.costs import cost_curve_for
from dspark.engine.drafting import draft_phase_seconds, target_step
from dspark.engine.engine import PREFILL_CHUNK, Engine
from dspark.engine.lookup import LookupProposer
from dspark.engine.scheduler import DEFAULT_THRESHOLD, AdaptiveScheduler, DraftPrior, make_scheduler
from dspark.errors import DSparkError
from dspark.model import fast as fast_draft
from dspark.model.load import load_draft
from dspark.target.load import SMOLLM2, auto_dtype, default_device, open_target, parse_dtype, target_numerics
from dspark.target.packcache import PackStore
from dspark.target.text import eos_ids

log = logging.getLogger("dspark")
BUNDLED_DRAFT = Path(__file__).parent / "assets" / "smollm2-draft"


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting; `dspark.cli.engine_flags` gives each one its flag (the same name with
    dashes; `check` is `--no-check`)."""

    target: str = SMOLLM2  # an HF model directory, or "smollm2"
    draft: str | None = None  # None: the bundled draft when the target is smollm2
    no_spec: bool = False  # plain decoding through the same engine (no draft loaded)
    # speculation from the request's own text alone (the lookup proposer): no draft loaded, so any
    # target speculates, a draft or not; proposals verified in full (the lookup prices its own)
    no_draft: bool = False
    dtype: str = "auto"  # auto (bf16 where the hardware has it natively, else fp32) | bf16 | fp32, or torch's spellings
    device: str | None = None  # None: cuda when available, else cpu
    runtime: str = "auto"  # target runtime: native where supported (auto), "native", or "hf" (transformers)
    # native weight format: auto (the model's own numbers; exact int4 where it is) | fp32 | bf16 | int8 | int4
    weights: str = "auto"
    # the draft's matrices on dspark's CPU kernels: auto | q4 | q8 | bf16 (model/fast.py; auto: Q4_1
    # matrices, Q8_0 head)
    draft_weights: str = "auto"
    # what dspark's int4 / Q8_0 matmuls (target and draft) do with their activations: auto (8-bit per
    # 32 inputs on AVX2, as llama.cpp runs the same file, and on Intel Xeon with AMX, where they are
    # faster; bf16 on other AVX-512 CPUs: kernels.int8_by_default) | int8 | bf16 (AVX2: closer
    # to the model's numbers, slower). Chosen once a process (kernels.choose_activations)
    activations: str = "auto"
    # which of dspark's CPU kernels run: auto (the best build this CPU has, its AMX tiles where the CPU
    # and the OS allow them) | amx | avx512 (that build without AMX tiles) | avx2 | generic (plain C++) |
    # torch (none: torch's ops). Each computes its own numbers; chosen once a process (kernels.choose_kernels)
    kernels: str = "auto"
    threads: int | None = None  # torch CPU threads (None: torch's default)
    layout: str | None = None  # force the draft's block layout against its file (experts; warned loudly)
    # verification policy: full | threshold | adaptive. None (default): adaptive with a draft (it verifies
    # what its measured cost curve says pays and skips drafting when the draft does not pay, so a weak
    # draft costs little against plain decoding), full without one
    verify: str | None = None
    threshold: float = DEFAULT_THRESHOLD  # confidence cut of `threshold`
    calibration: str | None = None  # STS file of `dspark calibrate` (threshold, adaptive)
    cost_curve: str | None = None  # adaptive: cost-curve JSON (None: profile the target at start-up, cached)
    always_draft: bool = False  # adaptive: draft every step, even when earlier steps say it does not pay
    max_batch: int = 16  # requests decoded together
    # proposals from the request's own text (prompt and output) beside the draft's, chosen per
    # request and step by expected tokens per second (engine/lookup.py); False: the draft alone
    lookup: bool = True
    # prompt tokens prefilled per engine step: a longer prompt is prefilled in chunks between the
    # decode steps of the running requests (engine.PREFILL_CHUNK)
    prefill_chunk: int = PREFILL_CHUNK
    check: bool = True  # the doctor's cheap check of the draft at load time


def default_draft(target: str) -> Path | None:
    """The project's own draft is used whenever the target is smollm2 and no draft is given."""
    if target == SMOLLM2 and (BUNDLED_DRAFT / "config.json").exists():
        return BUNDLED_DRAFT
    return None


def resolve_draft(target: str, draft: str | None, alternative: str) -> Path:
    """The draft a command runs: the one given, else the bundled one for smollm2, else an error
    naming what the user can do instead (`alternative`)."""
    path = draft or default_draft(target)
    if path is None:
        raise DSparkError(f"no draft given for target {target!r} (pass --draft PATH{alternative})")
    return Path(path)


def resolve(config: EngineConfig) -> tuple[EngineConfig, list[str]]:
    """The config with the choices made at load time written out (device, dtype "auto", the default
    draft), and one line per choice worth telling the user."""
    notes = []
    device = config.device or default_device()
    dtype = config.dtype
    if dtype == "auto":
        dtype, why = auto_dtype(device)
        notes.append(why)
    # a bad name or fp16 on CPU fails here, before anything loads
    given = None if config.dtype == "auto" else target_numerics(config.weights, parse_dtype(dtype, device))
    kernels.check_activations(config.activations)
    kernels.check_kernels(config.kernels)
    draft_weights = config.draft_weights
    if draft_weights not in fast_draft.DRAFT_WEIGHTS:
        raise DSparkError(f"draft weights must be one of {', '.join(fast_draft.DRAFT_WEIGHTS)}, got {draft_weights!r}")
    if given == "fp32":
        # an explicit fp32 is fp32 throughout (docs/DESIGN.md §10): the draft's own numbers on its
        # modules, since dspark's drafting kernels and its int4 / Q8_0 matmuls compute in bf16
        if draft_weights in fast_draft.KERNEL_WEIGHTS:
            raise DSparkError(
                f"--draft-weights {draft_weights} runs the draft on dspark's CPU kernels, which compute in bf16, "
                f"but --dtype fp32 asks for fp32: pass --dtype auto or bf16 with --draft-weights {draft_weights}, "
                "or --dtype fp32 with --draft-weights auto (the draft's own numbers in fp32)"
            )
        if config.activations != "auto":
            raise DSparkError(
                f"--activations {config.activations} sets what dspark's int4 / Q8_0 CPU matmuls do with their "
                "inputs, and with --dtype fp32 none runs (fp32 matmuls, or torch's int8 / int4 kernels with fp32 "
                f"inputs): pass --activations {config.activations} with --dtype auto or bf16, or --dtype fp32 "
                "with --activations auto"
            )
        draft_weights = "fp32"
    elif draft_weights == "fp32":
        raise DSparkError(
            f"--draft-weights fp32 runs the draft's modules in fp32, which --dtype {config.dtype} does not give: "
            "pass --dtype fp32 with --draft-weights fp32 (or auto), or another --draft-weights with "
            f"--dtype {config.dtype}"
        )
    if config.max_batch < 1:
        raise DSparkError(f"--max-batch must be >= 1, got {config.max_batch}")
    if config.prefill_chunk < 1:
        raise DSparkError(f"--prefill-chunk must be >= 1 prompt token a step, got {config.prefill_chunk}")
    if config.no_draft:
        if config.no_spec:
            raise DSparkError("--no-draft speculates from the text alone and --no-spec not at all: pass one of them")
        if config.draft is not None:
            raise DSparkError(f"--no-draft loads no draft, but --draft {config.draft} names one: pass one of them")
        if not config.lookup:
            raise DSparkError(
                "--no-draft with --no-lookup leaves nothing to propose: pass --no-spec for plain decoding"
            )
        if config.verify not in (None, "full"):
            raise DSparkError(
                f"--verify {config.verify} decides how much of a draft's block to verify, and --no-draft loads no "
                "draft (the lookup proposer sizes its own proposals): leave --verify out"
            )
    draft = (
        None if config.no_spec or config.no_draft else str(resolve_draft(config.target, config.draft, ", or --no-spec"))
    )
    verify = config.verify or ("full" if draft is None else "adaptive")
    return replace(config, device=device, dtype=dtype, draft=draft, verify=verify, draft_weights=draft_weights), notes


def build_engine(config: EngineConfig) -> Engine:
    """Load the target (and the draft unless no_spec), build the verification policy, check the
    draft. The engine keeps the resolved config (`engine.config`) and what to tell the user
    about it (`engine.notes`, e.g. which dtype "auto" chose)."""
    given_dtype = config.dtype != "auto"
    config, notes = resolve(config)
    device, verify = config.device, config.verify
    assert device is not None and verify is not None  # resolve() wrote them out
    if config.threads:
        torch.set_num_threads(config.threads)
    if device.startswith("cpu"):
        kernels.choose_kernels(config.kernels)
        kernels.choose_activations(config.activations)
    elif config.kernels != "auto":
        raise DSparkError(f"--kernels {config.kernels} names dspark's CPU kernels, and this engine runs on {device}")
    # the native runtime's packed weights (and the screens choosing their format), read back from
    # the dspark cache where an earlier start packed them for the same files, request and code
    request = {"weights": config.weights, "dtype": config.dtype, "dtype_given": given_dtype}
    packs = PackStore(config.target, device, request) if device.startswith("cpu") else None
    target, tokenizer, more = open_target(
        config.target, config.dtype, device, config.runtime, config.weights, dtype_given=given_dtype, packs=packs
    )
    actual = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(target.dtype, str(target.dtype).removeprefix("torch."))
    if not given_dtype and actual != config.dtype and notes and notes[0].startswith("dtype auto"):
        # the model's own int4 weights took bf16 activations where "auto" alone would say fp32, or
        # float --weights their own: one line that says what runs, not two that contradict each other
        why = notes[0].partition("(")[2].rstrip(")")
        notes[0] = (
            f"dtype auto -> {actual}: --weights {config.weights} runs with {actual} activations; "
            f"auto alone would give {config.dtype} here ({why})"
            if config.weights in ("fp32", "bf16")
            else f"dtype auto -> {actual}: the model's int4 weights run with bf16 activations"
            f"{kernels.q4_note().replace(', ', ' (') + ' in their matmuls)' if kernels.q4_note() else ''}; "
            f"other models would get {config.dtype} here ({why})"
        )
        config = replace(config, dtype=actual)
    notes += more
    model = target.checkpoint  # config and tensors: transformers' model is not built on this path
    draft = None
    if config.draft is not None:
        draft = load_draft(config.draft, model, layout=config.layout, dtype=target.dtype)
        fast_draft.set_weights(draft, config.draft_weights)
        if config.draft_weights in fast_draft.KERNEL_WEIGHTS and fast_draft.why_not(draft) is not None:
            raise DSparkError(
                f"--draft-weights {config.draft_weights} sets the matrices of dspark's CPU drafting kernels, which "
                f"do not run this draft ({fast_draft.why_not(draft)}): pass --draft-weights auto (its modules run "
                "it in its own numbers)"
            )
        notes.append(fast_draft.describe(draft))
        # taps on before the policy exists: an adaptive policy times verification as the engine runs it
        target.set_taps(draft.spec.hidden_state_indices)
    policy = make_scheduler(
        verify,
        target,
        draft,
        threshold=config.threshold,
        calibration=config.calibration,
        curve=config.cost_curve,
        max_batch=config.max_batch,
        skip=not config.always_draft,
    )
    lookup = None
    if config.lookup and (draft is not None or config.no_draft):
        lookup = LookupProposer()
        if policy.curve is None:  # full / threshold: the lookup proposer still prices its proposals
            policy.curve = cost_curve_for(target, config.max_batch * (lookup.limit + 1))
        notes.append(lookup.describe(draft is not None))
    engine = Engine(
        target,
        draft,
        tokenizer,
        eos_ids(model, tokenizer),
        policy=policy,
        max_batch=config.max_batch,
        lookup=lookup,
        prefill_chunk=config.prefill_chunk,
    )
    engine.config, engine.notes = config, notes
    if config.check and draft is not None:
        # the doctor's statistic on a short sample (dspark.doctor.quick.QUICK_BUDGET): about as much as
        # decoding 256 tokens, more only while another reading of the file could still be better;
        # measured once per target, draft, runtime and machine, then read back (dspark.doctor.cache)
        loaded = load_time_check(engine)
        check = loaded.check
        for warning in check.warnings:
            log.warning("WARNING: draft check: %s", warning)
        (log.warning if check.warnings else log.info)(loaded.describe())
        if check.accepted is not None:
            # what the check measured, plus the drafting phase's cost: an adaptive policy then knows
            # from the first step whether drafting pays, instead of drafting to find out. Timed after a
            # target step, as decoding meets it (cold caches), at one slot and at up to three: a CPU
            # verifies 1-3 slots, and the second figure prices each slot past the first
            accepted, step = check.accepted.numpy(), target_step(target)
            one = draft_phase_seconds(draft, evict=step, depth=1)
            deep = min(3, draft.spec.gamma)
            slot = max(0.0, draft_phase_seconds(draft, evict=step, depth=deep) - one) / (deep - 1) if deep > 1 else 0.0
            engine.prior = DraftPrior(accepted, draft.spec.gamma, one, 1, slot)
            if isinstance(policy, AdaptiveScheduler):
                policy.seed(engine.prior)
                notes.append(policy.summary())
    return engine


def load_engine(target: str = SMOLLM2, draft: str | None = None, **settings) -> Engine:
    """build_engine with the settings as keywords: load_engine("smollm2", dtype="fp32")."""
    return build_engine(EngineConfig(target=target, draft=draft, **settings))
