"""The bench PNG: readable log-axis labels and a title naming only the systems that ran (no root needed)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hybridep.bench import report as br


def _row(system: str) -> br.Row:
    kw = {f.name: 1.0 for f in dataclasses.fields(br.Row)}
    return br.Row(**{**kw, "system": system, "plan": system, "point": 0})


def test_title_names_only_the_systems_that_ran():
    assert br.systems_title([_row("hybridep"), _row("ep")]) == "alltoall EP vs HybridEP"
    assert br.systems_title([_row("hybridep-compressed")]) == "HybridEP-c"


def _labels(axis, renderer) -> list:
    """Boxes of the tick labels drawn inside the axis range (major and minor)."""
    lo, hi = sorted(axis.get_view_interval())
    ticks = axis.get_major_ticks() + axis.get_minor_ticks()
    return [t.label1.get_window_extent(renderer) for t in ticks
            if lo <= t.get_loc() <= hi and t.label1.get_visible() and t.label1.get_text()]


@pytest.mark.parametrize("xlim, ylim", [((0.5, 17.0), (0.22, 0.28)), ((0.5, 17.0), (0.18, 0.6)),
                                        ((3.0, 30.0), (0.2, 5.0)),  # matplotlib's own labels collide here
                                        ((1.5, 6.0), (1e-3, 50.0)), ((0.05, 400.0), (0.9, 1.1))])
def test_log_axis_labels_do_not_overlap(xlim, ylim):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(16 / 3, 4.8))
    ax.plot(list(xlim), list(ylim))
    ax.set(xscale="log", yscale="log")
    for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        br._log_ticks(axis, lo, hi)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for axis in (ax.xaxis, ax.yaxis):
        boxes = _labels(axis, renderer)
        assert len(boxes) >= 2, [t.get_text() for t in axis.get_ticklabels()]  # the axis is readable
        for i, a in enumerate(boxes):
            assert not any(a.overlaps(b) for b in boxes[i + 1:])
    plt.close(fig)


def _timed(system: str, point: int, median_s: float) -> br.Row:
    return dataclasses.replace(_row(system), point=point, median_s=median_s)


def test_layout_targets_compare_with_the_best_megatron_layout_per_point():
    """HybridEP and auto are held against the fastest of ep, replicated and pp at each point (not EP
    alone), and auto must be within 5% of the fastest other system."""
    rows = [_timed("ep", 0, 10.0), _timed("pp", 0, 2.0), _timed("hybridep", 0, 4.0), _timed("auto", 0, 1.9),
            _timed("ep", 1, 20.0), _timed("pp", 1, 6.0), _timed("hybridep", 1, 5.0), _timed("auto", 1, 5.5)]
    checks = {c.name: c for c in br.layout_targets(rows)}
    hyb = checks["HybridEP vs the best Megatron layout measured"]
    assert not hyb.ok and "1/2" in hyb.detail and "0.50x vs PP per DC" in hyb.detail
    assert checks["auto layout vs the best Megatron layout measured"].ok
    near = checks["auto layout within 5% of the fastest other system at every point"]
    assert not near.ok and near.detail.startswith("1/2")  # point 1: 5.5 s against HybridEP's 5.0 s
    assert checks["auto layout within 5% of the fastest exact system at every point"].detail.startswith("1/2")
    # compression is not auto's to choose: a faster HybridEP-c misses only the check against every system
    rows += [_timed("hybridep-compressed", 0, 1.0)]
    checks = {c.name: c for c in br.layout_targets(rows)}
    assert checks["auto layout within 5% of the fastest exact system at every point"].detail.startswith("1/2")
    assert checks["auto layout within 5% of the fastest other system at every point"].detail.startswith("0/2")
    # auto-c may compress, so it is held against every system, and named fastest only where it is
    rows += [_timed("auto-c", 0, 1.0), _timed("auto-c", 1, 5.5)]
    checks = {c.name: c for c in br.layout_targets(rows)}
    assert checks["auto-c layout within 5% of the fastest other system at every point"].detail == "1/2 points"
    fastest = checks["auto-c layout the fastest other system at >= 90% of points"]
    assert not fastest.ok and fastest.detail == "1/2 points"
    assert checks["auto layout the fastest exact system at >= 90% of points"].detail == "1/2 points"
    assert checks["auto layout within 5% of the fastest exact system at every point"].detail.startswith("1/2")


def test_prediction_misses_name_the_ones_the_unshaped_steps_noise_explains():
    """A prediction is the measured unshaped step plus the WAN's cost: a shaped step measured below
    the unshaped one is a miss that no network model can fix, and the check says how many are."""
    def row(system: str, unshaped: float, shaped: float, predicted: float) -> br.Row:
        return dataclasses.replace(_row(system), unshaped_s=unshaped, median_s=shaped, predicted_s=predicted,
                                   pred_error_pct=(predicted / shaped - 1) * 100)

    check = next(c for c in br.check_targets([row("ep", 2.11, 1.90, 2.33), row("pp", 2.0, 2.5, 3.0),
                                              row("replicated", 1.8, 2.4, 2.4)])
                 if c.name.startswith("predicted step"))
    assert not check.ok and "1/3 within" in check.detail
    assert "1 of the 2 misses measured faster shaped than unshaped" in check.detail, check.detail
    text = br.format_phases([row("ep", 2.11, 1.90, 2.33)])
    assert "-210/+220" in text.replace(" ", ""), text  # WAN cost, measured / predicted (ms)
    good = next(c for c in br.check_targets([row("ep", 1.0, 1.5, 1.5)]) if c.name.startswith("predicted step"))
    assert good.ok and "misses" not in good.detail
