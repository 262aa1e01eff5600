"""The llama.cpp arm of `dspark bench-runtime`: plain greedy decoding of the target's own GGUF file.

llama.cpp is the native-code bar a local CPU user compares against (issue 12): SmolLM2 ships as a
Q4_1 GGUF, and llama.cpp decodes that file as shipped. The arm needs `llama-cpp-python`, an
optional extra (`pip install 'dspark[llamacpp]'` builds llama.cpp from source: a C/C++ compiler
and cmake), never a dependency of the engine or of CI.

It measures what the other arms measure, with llama.cpp's own loop: tokens/s of greedy decoding
(prompt prefill included, as for `generate` and the engine) and the cost of one forward of s
tokens on a cache of `context` tokens with logits for every one of them (what a verification of
s tokens needs), the cache cut back to `context` before each forward.
"""

from __future__ import annotations

import importlib.util
import random
import statistics
from collections import Counter
from pathlib import Path

from dspark.engine.timing import now
from dspark.errors import DSparkError
from dspark.target.load import SMOLLM2, resolve_target, smollm2_gguf

ARM = "llamacpp"
INSTALL = (
    "pip install 'dspark[llamacpp]' (builds llama.cpp from source: needs a C/C++ compiler and cmake; "
    "`CMAKE_BUILD_PARALLEL_LEVEL=2` on a 2-core machine)"
)


def check_installed() -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise DSparkError(f"runtime arm {ARM!r} needs llama-cpp-python, which is not installed: {INSTALL}")


def gguf_file(target: str) -> Path:
    """The GGUF file llama.cpp decodes: SmolLM2's shipped file, or the one .gguf in a model directory."""
    if target == SMOLLM2:
        return smollm2_gguf()
    files = sorted(resolve_target(target).glob("*.gguf"))
    if len(files) != 1:
        raise DSparkError(
            f"runtime arm {ARM!r} decodes the target's GGUF file: {target} holds "
            f"{len(files)} .gguf files (it needs exactly one, or the target 'smollm2')"
        )
    return files[0]


class LlamaCppArm:
    """One GGUF file opened twice: a context that keeps only the last position's logits (plain
    decoding, as llama.cpp's own generate runs) and one with logits for every position (a
    verification's forward)."""

    runtime = "llama.cpp (llama-cpp-python)"
    head = ""

    def __init__(self, target: str, threads: int, n_ctx: int):
        check_installed()
        from llama_cpp import Llama  # optional extra: imported only when the arm runs

        path = gguf_file(target)
        self.format = _gguf_type(path)

        def context(logits_all: bool) -> Llama:
            # keywords spelt out, not **dict: a dict of mixed values is dict[str, object] to mypy,
            # which no parameter of llama_cpp's typed Llama.__init__ accepts
            return Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=min(512, n_ctx),
                n_threads=threads,
                n_threads_batch=threads,
                logits_all=logits_all,
                verbose=False,
            )

        self.plain = context(logits_all=False)
        self.verify = context(logits_all=True)

    def decode(self, ids: list[int], n: int) -> tuple[float, None]:
        """Greedy (temperature 0: llama.cpp's greedy sampler), n tokens, end-of-text ignored."""
        self.plain.reset()
        t = now("cpu")
        got = 0
        for _ in self.plain.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            got += 1
            if got == n:
                break
        dt = now("cpu") - t
        if got != n:
            raise DSparkError(f"llama.cpp stopped after {got} of {n} tokens")
        return n / dt, None  # no engine around llama.cpp's loop: no overhead to report

    def forward_costs(self, context: int, sizes=(1, 2, 4, 8), reps: int = 5, seed: int = 0) -> dict[int, float]:
        """Median seconds of a forward of s tokens on `context` cached tokens, logits for all s."""
        llm = self.verify
        rng = random.Random(seed)
        vocab = llm.n_vocab()
        llm.reset()
        llm.eval([rng.randrange(4, vocab) for _ in range(context)])
        out = {}
        for s in sizes:
            x = [rng.randrange(4, vocab) for _ in range(s)]
            times = []
            for _ in range(reps + 1):
                llm.n_tokens = context  # eval drops every cached position from n_tokens on first
                t = now("cpu")
                llm.eval(x)
                times.append(now("cpu") - t)
            out[s] = statistics.median(times[1:])
        return out

    def close(self) -> None:
        for llm in (self.plain, self.verify):
            llm.close()


def _gguf_type(path: Path) -> str:
    """'gguf Q4_1': the file's dominant tensor type, read with the `gguf` package (a dependency)."""
    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors if len(t.shape) > 1)
    return f"gguf {counts.most_common(1)[0][0]}" if counts else "gguf"
