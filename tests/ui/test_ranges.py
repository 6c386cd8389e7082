"""RangeFitter: server-side auto ranges of the streaming plots (qatlab/ui/ranges.py)."""
import math

import numpy as np
import pytest
from bokeh.models import ColumnDataSource

from qatlab.ui import figures as F
from qatlab.ui.ranges import X_HEADROOM, Y_MARGIN, RangeFitter


def _figs(log=False):
    src = ColumnDataSource({"step": [], "loss": [], "acc": []})
    xr = F.shared_x_range()
    loss = F.line_figure("loss", "loss", name="fig-loss", x_range=xr, y_log=log)
    a = F.add_line(loss, src, "step", "loss", color="red", name="a", label="a")
    F.finish(loss)
    acc = F.line_figure("acc", "acc", name="fig-acc", x_range=xr, y_range=F.fraction_range())
    F.add_line(acc, src, "step", "acc", color="red", name="b")
    return src, loss, acc, a


def _expected(lo, hi, dim):
    span = hi - lo
    return (lo, lo + X_HEADROOM * span) if dim == "x" else (lo - Y_MARGIN * span, hi + Y_MARGIN * span)


def test_fits_to_the_data_with_the_documented_margins_and_leaves_fixed_ranges_alone():
    src, loss, acc, _ = _figs()
    fitter = RangeFitter([loss, acc])
    src.stream({"step": [10, 20, 30], "loss": [2.0, 1.5, 1.0], "acc": [0.1, 0.2, 0.3]})
    fitter.update()
    assert (loss.x_range.start, loss.x_range.end) == pytest.approx(_expected(10, 30, "x"))
    assert (loss.y_range.start, loss.y_range.end) == pytest.approx(_expected(1.0, 2.0, "y"))
    assert (loss.x_range.reset_start, loss.x_range.reset_end) == (loss.x_range.start, loss.x_range.end)
    assert acc.x_range is loss.x_range
    assert (acc.y_range.start, acc.y_range.end) == (-0.02, 1.02)


def test_grows_only_when_data_leave_the_range():
    src, loss, acc, _ = _figs()
    fitter = RangeFitter([loss, acc])
    src.stream({"step": [0, 10], "loss": [2.0, 1.0], "acc": [0.0, 0.0]})
    fitter.update()
    before = (loss.x_range.end, loss.y_range.start, loss.y_range.end)
    src.stream({"step": [14], "loss": [1.5], "acc": [0.0]})          # inside: nothing moves
    fitter.update()
    assert (loss.x_range.end, loss.y_range.start, loss.y_range.end) == before
    src.stream({"step": [16, 30], "loss": [0.5, math.nan], "acc": [0.0, 0.0]})   # NaN is ignored
    fitter.update()
    assert loss.x_range.end == pytest.approx(_expected(0, 30, "x")[1])
    assert (loss.y_range.start, loss.y_range.end) == pytest.approx(_expected(0.5, 2.0, "y"))


def test_user_zoom_wins_until_reset():
    src, loss, acc, _ = _figs()
    fitter = RangeFitter([loss, acc])
    src.stream({"step": [0, 10], "loss": [2.0, 1.0], "acc": [0.0, 0.0]})
    fitter.update()
    fitted = (loss.x_range.start, loss.x_range.end)
    loss.x_range.update(start=2.0, end=4.0)                           # as a box zoom from the browser
    src.stream({"step": [100], "loss": [1.0], "acc": [0.0]})
    fitter.update()
    assert (loss.x_range.start, loss.x_range.end) == (2.0, 4.0)
    loss.x_range.update(start=loss.x_range.reset_start, end=loss.x_range.reset_end)   # the reset tool
    assert (loss.x_range.start, loss.x_range.end) == fitted
    fitter.update()
    assert loss.x_range.end == pytest.approx(_expected(0, 100, "x")[1])


def test_hidden_lines_are_left_out_and_showing_them_refits():
    src = ColumnDataSource({"step": [0.0, 10.0], "a": [1.0, 2.0], "b": [50.0, 60.0]})
    fig = F.line_figure("t", "y", name="fig-t")
    F.add_line(fig, src, "step", "a", color="red", name="a")
    rb = F.add_line(fig, src, "step", "b", color="blue", name="b")
    fitter = RangeFitter([fig])
    fitter.update()
    assert fig.y_range.end == pytest.approx(_expected(1.0, 60.0, "y")[1])
    rb.visible = False
    fitter.update()
    assert (fig.y_range.start, fig.y_range.end) == pytest.approx(_expected(1.0, 2.0, "y"))
    rb.visible = True
    fitter.update()
    assert fig.y_range.end == pytest.approx(_expected(1.0, 60.0, "y")[1])


def test_log_axis_fits_positive_values_in_log_units():
    src, loss, acc, _ = _figs(log=True)
    fitter = RangeFitter([loss, acc])
    src.stream({"step": [0, 1, 2], "loss": [0.0, 0.01, 100.0], "acc": [0, 0, 0]})
    fitter.update()
    lo, hi = _expected(-2.0, 2.0, "y")
    assert (loss.y_range.start, loss.y_range.end) == pytest.approx((10 ** lo, 10 ** hi))


@pytest.mark.parametrize("seed", range(5))
def test_incremental_extent_matches_a_full_scan_after_appends_thinning_rewrites_and_rollover(seed):
    rng = np.random.default_rng(seed)
    src = ColumnDataSource({"step": np.zeros(0), "y": np.zeros(0)})
    cap = 40
    fig = F.line_figure("t", "y", name="fig-t")
    F.add_line(fig, src, "step", "y", color="red", name="y")
    fitter = RangeFitter([fig])
    (managed_y,) = [m for m in fitter.ranges if m.dim == "y"]
    step = 0
    for _ in range(60):
        action = rng.integers(5)
        if action == 0 and len(src.data["y"]) > 4:                     # thinning replaces the data
            src.data = {c: np.asarray(v)[::2] for c, v in src.data.items()}
        elif action == 1 and len(src.data["y"]):                       # smoothing rewrites a column in place
            src.data.update({"y": (np.asarray(src.data["y"]) * rng.normal()).tolist()})
        elif action == 2:                                               # a big batch streams as arrays
            n = int(rng.integers(1, 30))
            src.stream({"step": np.arange(step, step + n, dtype=float), "y": rng.normal(size=n)}, rollover=cap)
            step += n
        else:
            n = int(rng.integers(1, 6))
            vals = rng.normal(size=n) * 10
            vals[rng.random(n) < 0.2] = np.nan
            src.stream({"step": list(range(step, step + n)), "y": vals.tolist()}, rollover=cap)
            step += n
        y = np.asarray(src.data["y"], dtype=float)
        y = y[np.isfinite(y)]
        extent = managed_y.extent()
        if len(y):
            assert extent == (y.min(), y.max())
        else:
            assert extent is None


def test_x_ends_at_the_data_once_the_runs_have_ended():
    from qatlab.ui.ranges import X_FINAL_MARGIN

    src, loss, acc, _ = _figs()
    fitter = RangeFitter([loss, acc])
    src.stream({"step": [0, 500], "loss": [2.0, 1.0], "acc": [0.0, 0.0]})
    fitter.update()
    src.stream({"step": [700], "loss": [0.9], "acc": [0.0]})          # inside the headroom
    fitter.update()
    assert loss.x_range.end == pytest.approx(X_HEADROOM * 500)
    fitter.update(final=True)
    assert (loss.x_range.start, loss.x_range.end) == pytest.approx((0, 700 * (1 + X_FINAL_MARGIN)))
    assert loss.x_range.end <= 1.05 * 700
    end = loss.x_range.end
    fitter.update(final=True)                                          # settled: nothing moves
    assert loss.x_range.end == end
    src.stream({"step": [930], "loss": [0.8], "acc": [0.0]})          # a late row: still tight
    fitter.update(final=True)
    assert loss.x_range.end == pytest.approx(930 * (1 + X_FINAL_MARGIN))
    y = (loss.y_range.start, loss.y_range.end)
    assert y == pytest.approx(_expected(0.8, 2.0, "y"))                # y keeps its margin
