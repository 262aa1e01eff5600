"""Target features for training: tapped hidden states and the final (post-norm) hidden states.

Tap index i is the input of decoder layer i (HF hidden_states[i]) read by forward hooks,
exactly as the engine's HFTarget taps them. The final hidden state is stored after the
target's final norm, so target logits are just `lm_head(final)`; `check_head` proves that
on the real target before anything is trained (a target that transforms logits after its
LM head, e.g. soft-capping, is refused instead of being silently mis-distilled).

Two sources with one interface, `get(indices) -> [(taps [L, n*H], final [L, H])]`:
OnlineFeatures runs the target for every batch; CachedFeatures reads a bf16 cache written once
by `build_cache` (raw little-endian bf16 files + meta.json, memory-mapped).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from dspark.model.taps import SINK_OUTLIER, per_dim_rms
from dspark.target.hf import decoder_layers
from dspark.target.native import NativeTarget
from dspark.target.native import supports as native_supports
from dspark.target.quant import FLOAT_NAMES
from dspark.train.config import FEATURE_RUNTIMES
from dspark.train.dataset import Sequence
from dspark.train.errors import TrainError

CACHE_VERSION = 1


def check_taps(taps: tuple[int, ...], num_layers: int) -> None:
    bad = [i for i in taps if not 0 <= i <= num_layers]
    if bad:
        raise TrainError(f"taps {bad} outside 0..{num_layers} for this {num_layers}-layer target")


def right_padded(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, W] right-padded with 0 and lengths [B] (causal attention: padding never reaches a real position)."""
    lengths = torch.tensor([len(s.ids) for s in seqs])
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s.ids)] = s.ids
    return ids, lengths


class TapCapture:
    """Forward hooks that record the inputs of the chosen decoder layers (index 0 = embeddings)."""

    def __init__(self, model, taps: tuple[int, ...]):
        layers = decoder_layers(model)
        check_taps(taps, len(layers))
        self.taps = tuple(taps)
        self.captured: dict[int, torch.Tensor] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        for i in self.taps:
            module = model.get_input_embeddings() if i == 0 else layers[i - 1]
            self._hooks.append(module.register_forward_hook(self._hook(i)))

    def _hook(self, i):
        def hook(_m, _inp, out):
            self.captured[i] = out[0] if isinstance(out, tuple) else out

        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


@torch.no_grad()  # not inference_mode: the features feed autograd-tracked draft layers
def run_target(model, cap: TapCapture, seqs: list[Sequence]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One right-padded batch (causal attention: padding never reaches a real position)."""
    dev = next(model.parameters()).device
    ids, lengths = right_padded(seqs)
    attn = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    cap.captured.clear()
    final = model.get_decoder()(input_ids=ids.to(dev), attention_mask=attn.to(dev)).last_hidden_state
    taps = torch.cat([cap.captured[i] for i in cap.taps], dim=-1)
    return [(taps[b, : len(s.ids)], final[b, : len(s.ids)]) for b, s in enumerate(seqs)]


@torch.no_grad()  # not inference_mode: the features feed autograd-tracked draft layers
def run_native(target: NativeTarget, seqs: list[Sequence]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """run_target on dspark's native runtime (its taps are set to the draft's): one right-padded
    batch through a fresh cache, the final states post-norm as `last_hidden_state` is."""
    ids, counts = right_padded(seqs)
    final, taps = target.forward_final(target.new_state(len(seqs)), ids, counts)
    if taps is None:
        raise RuntimeError("run_native: the target taps no layer (set its taps to the draft's first)")
    return [(taps[b, : len(s.ids)], final[b, : len(s.ids)]) for b, s in enumerate(seqs)]


class Extractor:
    """Target features of padded batches on one runtime: 'hf' (forward hooks on the transformers
    model), 'native' (dspark's runtime, dspark.target.native, with the model's own weights in the
    model's dtype: the same states, computed with fused projections and no HF overhead) or 'engine'
    (dspark's runtime as the engine runs a prompt: `weights auto`, 4-bit where the model's weights
    are exactly 4-bit, the activations `--activations auto` picks on this CPU, and on CPUs with
    AMX-BF16 a long prompt's matmuls on bf16 copies, dspark.target.dense; the states of the target
    the draft will be verified against, several times faster on a CPU, not bit-equal to the model's
    float ones)."""

    def __init__(self, model, taps: tuple[int, ...], runtime: str = "hf"):
        if runtime not in FEATURE_RUNTIMES:
            raise TrainError(f"--feature-runtime must be one of {', '.join(FEATURE_RUNTIMES)}, got {runtime!r}")
        ok, why = native_supports(model)
        self.runtime = runtime = ("native" if ok else "hf") if runtime == "auto" else runtime
        if runtime in ("native", "engine"):
            if not ok:
                raise TrainError(f"--feature-runtime {runtime}: {why}")
            check_taps(taps, model.config.num_hidden_layers)
            weights = "auto" if runtime == "engine" else FLOAT_NAMES[model.dtype]
            self.native = NativeTarget(model, tap_indices=tuple(taps), weights=weights)
        else:
            self.cap = TapCapture(model, taps)
        self.model = model

    def __call__(self, seqs: list[Sequence]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return run_target(self.model, self.cap, seqs) if self.runtime == "hf" else run_native(self.native, seqs)

    def close(self) -> None:
        if self.runtime == "hf":
            self.cap.close()


@torch.no_grad()  # a check: no graph (and no requires_grad-to-scalar warning)
def check_head(model, seq: Sequence) -> None:
    """The target's logits must equal lm_head(post-norm final hidden state) on a real sequence."""
    dev = next(model.parameters()).device
    ids = seq.ids[None, :64].to(dev)
    full = model(input_ids=ids).logits.float()
    mine = model.get_output_embeddings()(model.get_decoder()(input_ids=ids).last_hidden_state).float()
    scale = full.abs().max().clamp_min(1e-6)
    if float((full - mine).abs().max() / scale) > 1e-2:
        raise TrainError(
            f"{type(model).__name__}: logits are not lm_head(final hidden state) (soft-capping or scaling after "
            "the LM head?): this target cannot be distilled from cached hidden states"
        )


def batches(indices: list[int], seqs: list[Sequence], max_tokens: int):
    """Group indices so each padded batch stays under max_tokens (one long sequence goes alone)."""
    cur: list[int] = []
    for i in indices:
        width = max([len(seqs[j].ids) for j in cur + [i]])
        if cur and width * (len(cur) + 1) > max_tokens:
            yield cur
            cur = []
        cur.append(i)
    if cur:
        yield cur


class OnlineFeatures:
    def __init__(self, model, taps: tuple[int, ...], seqs: list[Sequence], max_tokens: int = 4096, runtime: str = "hf"):
        self.model, self.seqs, self.max_tokens = model, seqs, max_tokens
        self.extract = Extractor(model, taps, runtime)
        check_head(model, seqs[0])

    def get(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        found: dict[int, tuple] = {}
        for group in batches(indices, self.seqs, self.max_tokens):
            for i, f in zip(group, self.extract([self.seqs[j] for j in group])):
                found[i] = f
        return [found[i] for i in indices]


def numbers(runtime: str) -> str:
    """What a feature runtime's states are: 'engine' (the engine's 4-bit target) or 'model' (the
    model's own float weights: hf and native give the same states)."""
    return "engine" if runtime == "engine" else "model"


def data_digest(seqs: list[Sequence]) -> str:
    h = hashlib.sha1()
    for s in seqs:
        h.update(s.ids.numpy().astype("<i4").tobytes())
        h.update(b"|")
    return h.hexdigest()


def _bf16_bytes(x: torch.Tensor) -> bytes:
    return x.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().astype("<i2").tobytes()


def build_cache(
    model,
    taps: tuple[int, ...],
    seqs: list[Sequence],
    out,
    *,
    target_name: str,
    max_tokens: int = 4096,
    progress: bool = True,
    runtime: str = "hf",
) -> Path:
    """Write features of every sequence to `out` (bf16); returns out. Reuses a matching complete cache."""
    out = Path(out)
    digest = data_digest(seqs)
    if (out / "meta.json").exists():
        CachedFeatures(out, taps, seqs, runtime)  # raises if it does not match
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    check_head(model, seqs[0])
    extract = Extractor(model, taps, runtime)
    widths = None
    lengths = [len(s.ids) for s in seqs]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # Batches of similar lengths pad little (data order pads a batch to its longest answer);
    # each sequence is still written at its own place in data order.
    by_length = sorted(range(len(seqs)), key=lambda i: lengths[i])
    bar = tqdm(total=int(starts[-1]), desc="target features", unit="tok", disable=not progress)
    try:
        with open(tmp / "taps.bin", "wb") as ft, open(tmp / "final.bin", "wb") as ff:
            for group in batches(by_length, seqs, max_tokens):
                for j, (t, fin) in zip(group, extract([seqs[j] for j in group])):
                    widths = (t.shape[-1], fin.shape[-1])
                    ft.seek(int(starts[j]) * widths[0] * 2)
                    ft.write(_bf16_bytes(t))
                    ff.seek(int(starts[j]) * widths[1] * 2)
                    ff.write(_bf16_bytes(fin))
                    bar.update(t.shape[0])
    finally:
        extract.close()
        bar.close()
    assert widths is not None  # seqs is not empty (check_head read its first): a batch ran
    meta = {
        "version": CACHE_VERSION,
        "target": target_name,
        "taps": list(taps),
        "tap_width": widths[0],
        "hidden": widths[1],
        "lengths": lengths,
        "data_digest": digest,
        "dtype": "bfloat16",
        "numbers": numbers(runtime),
    }
    (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def cache_bytes(path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


class CachedFeatures:
    def __init__(self, path, taps: tuple[int, ...], seqs: list[Sequence], runtime: str | None = None):
        """runtime: the --feature-runtime the caller asked for; a cache of the other numbers (the
        engine's 4-bit target against the model's float weights) is refused. None: any."""
        path = Path(path)
        if not (path / "meta.json").exists():
            raise TrainError(f"{path} is not a feature cache (no meta.json; an interrupted build leaves *.partial)")
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("version") != CACHE_VERSION:
            raise TrainError(f"{path}: feature cache version {meta.get('version')} (this dspark reads {CACHE_VERSION})")
        if tuple(meta["taps"]) != tuple(taps):
            raise TrainError(
                f"{path} caches taps {meta['taps']} but the draft taps {list(taps)}: "
                "delete it to rebuild it, or use another cache directory"
            )
        if meta["lengths"] != [len(s.ids) for s in seqs] or meta["data_digest"] != data_digest(seqs):
            raise TrainError(
                f"{path} was built from other training data (or another --max-seq-len): "
                "delete it to rebuild it, or use another cache directory"
            )
        have = meta.get("numbers", "model")  # caches written before `numbers` hold the model's
        if runtime is not None and have != numbers(runtime):
            whose = {"engine": "engine", "model": "float model"}
            raise TrainError(
                f"{path} caches the {whose[have]}'s states but --feature-runtime {runtime} asks for the "
                f"{whose[numbers(runtime)]}'s: delete it to rebuild it, or use another cache directory"
            )
        offsets = np.concatenate([[0], np.cumsum(meta["lengths"])]).astype(np.int64)
        total = int(offsets[-1])
        self.taps = np.memmap(path / "taps.bin", dtype="<i2", mode="r", shape=(total, meta["tap_width"]))
        self.final = np.memmap(path / "final.bin", dtype="<i2", mode="r", shape=(total, meta["hidden"]))
        self.offsets, self.meta = offsets, meta

    def get(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for i in indices:
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            t = torch.from_numpy(np.array(self.taps[a:b])).view(torch.bfloat16)
            f = torch.from_numpy(np.array(self.final[a:b])).view(torch.bfloat16)
            out.append((t, f))
        return out


# ---- input conditioning ---------------------------------------------------------------------


def tap_scale(features, indices: list[int], n_taps: int, outlier: float = SINK_OUTLIER) -> torch.Tensor:
    """[W] per-dimension RMS of the tapped states over the sequences `indices`.

    Residual streams carry a few "massive" dimensions (SmolLM2's layer-28 input has two at
    |mean| 450 and 260, against a typical spread of 16) and a few sink positions at RMS ~1000.
    Fed raw to fc, Adam moves those columns' contributions hundreds of times faster than the
    rest, and the context the draft attends over barely varies between positions. Training
    therefore reads taps / scale and folds the scale into fc at export (`fold_tap_scale`):
    the same function, better conditioned. Positions whose RMS is `outlier` times a tap's
    median (sinks) do not set the scale.
    """
    rows = torch.cat([t.float() for t, _ in features.get(indices)])  # [N, W]
    return per_dim_rms(rows, n_taps, outlier)


def fold_tap_scale(fc_weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fc trained on taps / scale -> the fc that reads raw taps: W[:, j] / scale[j]."""
    return (fc_weight.float() / scale.to(fc_weight.device).float()[None, :]).to(fc_weight.dtype)


class ScaledFeatures:
    """Features whose taps are divided by a fixed per-dimension scale (see tap_scale)."""

    def __init__(self, inner, scale: torch.Tensor):
        self.inner, self.scale = inner, scale.float()

    def get(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(t.float() / self.scale, f) for t, f in self.inner.get(indices)]
