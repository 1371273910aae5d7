"""The host-to-device fit of the calibration probes (:func:`specfit.calibrate.probes.fit_h2d`)."""

from __future__ import annotations

import pytest

from specfit.calibrate.probes import fit_h2d


def _rows(gbps, overhead_s, pinned):
    return [{"bytes": b, "pinned": pinned, "seconds": overhead_s + b / (gbps * 1e9)} for b in (1e6, 2e6, 4e6, 8e6)]


def test_fit_h2d_fits_only_the_rows_of_the_memory_kind_asked_for():
    rows = _rows(20.0, 10e-6, True) + _rows(5.0, 30e-6, False)
    pinned, pageable = fit_h2d(rows, pinned=True), fit_h2d(rows, pinned=False)
    assert pinned["gbps"] == pytest.approx(20.0, rel=1e-6)
    assert pinned["overhead_s"] == pytest.approx(10e-6, rel=1e-6)
    assert pageable["gbps"] == pytest.approx(5.0, rel=1e-6)
    assert pageable["overhead_s"] == pytest.approx(30e-6, rel=1e-6)
    assert pinned["r2"] == pytest.approx(1.0)


def test_fit_h2d_never_reports_a_negative_per_copy_overhead():
    rows = [{"bytes": b, "pinned": True, "seconds": -5e-6 + b / 10e9} for b in (1e6, 2e6, 4e6, 8e6)]
    fit = fit_h2d(rows)
    assert fit["overhead_s"] == 0.0
    assert fit["gbps"] == pytest.approx(10.0, rel=1e-6)
