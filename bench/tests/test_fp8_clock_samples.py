"""bench/fp8/clocks.py's reading of nvidia-smi samples (the GPU part runs on the device machine)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "fp8"))

import clocks  # noqa: E402


def test_samples_that_are_not_three_numbers_are_skipped() -> None:
    text = "1980, 650.12, 55\n[N/A], 1, 2\n1755, 699.9, 60\n1, 2\n1500, 700.0, 61\n"
    assert clocks.parse_samples(text) == [
        (1980.0, 650.12, 55.0),
        (1755.0, 699.9, 60.0),
        (1500.0, 700.0, 61.0),
    ]


def test_summary_drops_the_ramps_at_both_ends() -> None:
    # 10 samples: a ramp (345 MHz idle, then 1980) at the start, a tail at the end, 1500 between.
    samples = (
        [(345.0, 80.0, 40.0), (1980.0, 300.0, 41.0)]
        + [(1500.0, 700.0, 60.0)] * 6
        + [(1980.0, 90.0, 50.0)] * 2
    )
    got = clocks.summarise(samples)
    assert got["samples"] == 6
    assert got["sm_mhz_median"] == got["sm_mhz_p10"] == got["sm_mhz_p90"] == 1500.0
    assert got["power_w_median"] == 700.0 and got["temp_c_max"] == 60.0


def test_short_windows_keep_every_sample_and_empty_ones_say_so() -> None:
    assert clocks.summarise([(1600.0, 650.0, 55.0)] * 4)["samples"] == 4
    assert clocks.summarise([]) == {"samples": 0}
