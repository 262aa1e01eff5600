"""bench/fingerprint.py: fc's column norms name the layers a tap-scaled fc was fitted to, and say
nothing about an fc fitted to raw taps."""

from __future__ import annotations

import torch
from dspark.bench.fingerprint import FIT_RATIO, MIN_EXPLAINED, layer_rms, points_to, tap_fit
from dspark.train.features import fold_tap_scale

H = 96


def _profiles(seed=0, layers=6):
    """Per-dimension RMS of a residual stream: a lognormal profile that drifts layer by layer,
    with a few 'massive' dimensions growing with depth."""
    g = torch.Generator().manual_seed(seed)
    log = torch.randn(H, generator=g) * 0.5
    out = {}
    for i in range(layers):
        log = log + torch.randn(H, generator=g) * 0.3
        log[:3] += 0.6
        out[i] = log.exp()
    return out


def test_the_folded_layers_fit_best_and_a_shift_is_named():
    rms = _profiles()
    g = torch.Generator().manual_seed(1)
    true = (1, 3)
    fc = fold_tap_scale(torch.randn(H, 2 * H, generator=g) * 0.02, torch.cat([rms[i] for i in true]))
    fits = {d: tap_fit(fc, rms, tuple(i + d for i in true)) for d in (-1, 0, 1)}
    assert fits[0].misfit < fits[-1].misfit and fits[0].misfit < fits[1].misfit
    assert fits[0].explained > MIN_EXPLAINED
    # a file that says taps - 1: the weights point to the true ones, never the other way
    assert points_to(fits[-1], fits[0]) and not points_to(fits[0], fits[-1]) and not points_to(fits[0], fits[1])
    assert fits[-1].misfit >= FIT_RATIO * fits[0].misfit


def test_raw_tap_weights_carry_no_fingerprint():
    """fc fitted to raw taps (another trainer) or untouched: the profiles explain none of its column norms."""
    rms = _profiles()
    fc = torch.randn(H, 2 * H, generator=torch.Generator().manual_seed(2)) * 0.02
    fits = {d: tap_fit(fc, rms, (1 + d, 3 + d)) for d in (-1, 0, 1)}
    assert all(f.explained < MIN_EXPLAINED for f in fits.values())
    assert not any(points_to(fits[0], fits[d]) for d in (-1, 1))


def test_layer_rms_reads_generated_positions_only_and_leaves_sinks_out():
    g = torch.Generator().manual_seed(3)
    states = torch.randn(40, H, generator=g)
    states[:8] *= 50.0  # the prompt: another scale, not what the draft was fitted on
    states[20] *= 1000.0  # a sink position
    rms = layer_rms([({4: states}, 8)], [4])[4]
    keep = torch.cat([states[8:20], states[21:]])
    assert torch.allclose(rms, keep.pow(2).mean(0).sqrt(), rtol=1e-5)
