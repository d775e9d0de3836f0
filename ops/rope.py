"""Llama-3.1 RoPE frequency scaling (HF `rope_type: "llama3"`), kept out of the model so the
decoder stays one function of its config.

Long-wavelength (low-frequency) components are slowed by `factor` so positions past the original
training length stay in the range the model saw; short wavelengths are left alone; the band in
between is interpolated. Same float32 arithmetic as transformers' `_compute_llama3_parameters`.
"""

from __future__ import annotations

import math

import torch

from services.common.config import RopeScaling


def llama3_scale_freqs(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_context_len = s.original_max_position_embeddings
    low_freq_wavelen = old_context_len / s.low_freq_factor
    high_freq_wavelen = old_context_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)
