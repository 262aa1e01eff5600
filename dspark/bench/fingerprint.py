"""Which target layers a draft's fc was fitted to, read from its weights (used by `dspark doctor`).

Behaviour cannot name the taps of a draft that barely uses them: a weakly trained draft accepts
the same tokens from layers 14 and 15 (docs/history/benchmarks.md, "Calibration"). Its weights still
can. `dspark train` feeds fc taps divided by their per-dimension RMS and folds that scale into
fc when it exports (train/features.py, `tap_scale`), so column j of fc starts as
c / RMS_layer(j) of its true tap layer and keeps that shape until training moves it far.
Residual streams differ between neighbouring layers in exactly that profile (SmolLM2's massive
dimensions grow layer by layer), so

    misfit(layer) = variance over j of ( log ||fc[:, j]|| + log RMS_layer(j) )

is smallest at the layer fc was fitted to. It is summed over the taps of a reading. Drafts
trained on raw taps (other trainers) do not carry the profile: the profile then explains little
of the column norms' spread and the fingerprint says nothing (`points_to`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.model.taps import per_dim_rms

FIT_RATIO = 1.4  # a reading's taps fit fc this many times better than the declared ones: a finding
# share of the variance of log ||fc[:, j]|| that a reading's RMS profile explains: fc carries a tap scale at all
MIN_EXPLAINED = 0.5


@dataclass(frozen=True)
class TapFit:
    """How well fc's column norms match the RMS profile of one set of tap layers."""

    taps: tuple[int, ...]
    misfit: float  # summed over taps
    spread: float  # variance of log ||fc[:, j]||, summed over taps
    correlation: float  # mean over taps of corr(log ||fc[:, j]||, -log RMS(j))

    @property
    def explained(self) -> float:
        """1 - misfit / spread: near 1 when the profile accounts for fc's column norms, below 0 when
        the norms do not follow it at all (adding an unrelated profile adds variance)."""
        return 1.0 - self.misfit / max(self.spread, 1e-12)

    def to_json(self) -> dict:
        return {
            "taps": list(self.taps),
            "misfit": round(self.misfit, 5),
            "explained": round(self.explained, 4),
            "correlation": round(self.correlation, 4),
        }


def layer_rms(texts: list[tuple[dict, int]], layers) -> dict[int, torch.Tensor]:
    """texts: (tap index -> [T, H] states, prompt length) -> per-dimension RMS [H] of each layer's
    input over the generated positions (sinks left out).

    Generated positions only: they are what a draft is trained on, and the prompts' positions
    (short texts are mostly chat template) shift the profile: on SmolLM2's held-out answers the
    lie's ratio fell from 1.8 to 1.5 with the prompts in."""
    return {i: per_dim_rms(torch.cat([t[i][n:].float().cpu() for t, n in texts]), 1) for i in layers}


def tap_fit(fc_weight: torch.Tensor, rms: dict[int, torch.Tensor], taps: tuple[int, ...]) -> TapFit:
    """fc_weight [H, n_taps * Hin]; rms: layer -> [Hin]."""
    w = fc_weight.detach().float().cpu()
    h_in = w.shape[1] // len(taps)
    misfit, spread, corr = 0.0, 0.0, 0.0
    for k, layer in enumerate(taps):
        y = w[:, k * h_in : (k + 1) * h_in].norm(dim=0).clamp_min(1e-12).log()  # [Hin]
        x = rms[layer].log()
        misfit += float((y + x).var())
        spread += float(y.var())
        corr += float(torch.corrcoef(torch.stack([y, -x]))[0, 1])
    return TapFit(tuple(taps), misfit, spread, corr / len(taps))


def points_to(declared: TapFit, alt: TapFit) -> bool:
    """The weights say `alt`'s layers, not the declared ones, are what fc was fitted to."""
    return alt.explained >= MIN_EXPLAINED and declared.misfit >= FIT_RATIO * alt.misfit
