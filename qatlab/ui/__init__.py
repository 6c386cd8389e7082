"""qatlab.ui: Panel/Bokeh views of live runs (``pn.viewable.Viewer`` classes; no training logic).

Views (each displays inline in a notebook and has ``pull()`` = one streaming tick):

- :class:`Dashboard` — sidebar + tabs of one session (``app/main.py`` serves it);
- :class:`ConfigPanel` — config widgets, ``Start`` / ``Stop`` / ``Pause`` / ``Resume`` /
  ``Compare STE kinds`` buttons, ``Keep running after this page closes`` checkbox;
- :class:`RunStatus` — progress bar, steps/s, ETA, ``Status: <status>``;
- :class:`RunView` (Overview), :class:`SteCompareView`, :class:`QuantView`, :class:`PhaseView`,
  :class:`RunsTable`.

Stable Bokeh model names, for ``Bokeh.documents[0].get_model_by_name(name)`` in a browser:

- sources (one set per shown run and session): ``loss-source-<run id>`` (training rows, loss only:
  ``step``, ``time``, ``loss``, ``loss_s`` (EMA), streamed every tick), ``train-source-<run id>``
  (training rows, every metric: ``loss``, per-layer metrics, phase columns, ...; about once a
  second, on a tick that streams rows), ``eval-source-<run id>`` (epoch rows: ``test_loss``,
  ``test_accuracy``, ...; with the training source),
  ``phase-source-<run id>`` (phase segments); histogram sources ``hist-latent-layer<i>`` and
  ``hist-quant-layer<i>`` (see :mod:`qatlab.ui.streaming` for the columns);
- figures: ``fig-loss``, ``fig-accuracy``, ``fig-speedup``; ``fig-ste-loss``, ``fig-ste-accuracy``,
  and, once the comparison's Per-layer detail card is opened, ``fig-ste-grad_norm``,
  ``fig-ste-noise_mse``, ``fig-ste-sqnr_db``, ``fig-ste-active_grad_fraction``;
  ``fig-hist-latent-<i>``, ``fig-hist-quant-<i>``, ``fig-quant-fractions``, ``fig-quant-scale``,
  ``fig-quant-saturation``, ``fig-quant-sqnr``; ``fig-phase-timeline``, ``fig-phase-backward``,
  ``fig-phase-pred``, ``fig-phase-lengths``; ``fig-runs-loss``, ``fig-runs-accuracy``;
- renderers: ``loss-<run id>`` (EMA), ``loss-raw-<run id>``, ``test-loss-<run id>``,
  ``test-accuracy-<run id>``, ``phase-bands-<run id>-<PHASE>``, ``ste-loss-<run id>``,
  ``ste-accuracy-<run id>``, ``runs-loss-<run id>``, ... (each module lists its own);
- CSS classes on Panel components (their text lives in the element's shadow root; Playwright's
  selectors pierce it, e.g. ``page.get_by_text(re.compile("Status: finished"))``):
  ``qatlab-status`` (``Status: <status>``), ``qatlab-progress`` (bar), ``qatlab-progress-text``
  (``step a / b · r steps/s · ETA t``), ``qatlab-run-alert``, ``qatlab-config-error``,
  ``qatlab-ste-summary`` (ranking table), ``qatlab-ste-detail`` (the Per-layer detail card),
  ``qatlab-runs-table`` (Tabulator),
  ``qatlab-plot-controls``.

Plumbing: :mod:`~qatlab.ui.streaming` (log rows -> sources), :mod:`~qatlab.ui.figures` (figure
factories), :mod:`~qatlab.ui.ranges` (server-fitted axis ranges), :mod:`~qatlab.ui.internals`
(every use of private Panel/Bokeh internals, behind ``QATLAB_PANEL_INTERNALS``),
:mod:`~qatlab.ui.theme` (air-gapped template).

Every callback that changes the page runs under ``pn.io.hold`` (:func:`~qatlab.ui.base.one_message`),
so its updates go out as one message on Panel's write queue, never on Bokeh's own path, which
can overtake Panel's queue (the browser tests check no patch went that way).

Run ids are the run store's (``RemoteRun.id``). Tabs are ``Overview``, ``STE comparison``,
``Quantization``, ``Phases``, ``Runs``, ``Sweeps``; a tab's figures are built and enter the page
when the tab is opened, and only the open tab's runs are streamed.
"""
from ..runtime.blas import limit_blas_threads  # noqa: F401  (re-exported; `import qatlab` applies it)
from .base import LiveView, PlotOptions  # noqa: E402
from .config_panel import ConfigPanel  # noqa: E402
from .dashboard import DASHBOARDS, Dashboard  # noqa: E402
from .phase_view import PhaseView  # noqa: E402
from .quant_view import QuantView  # noqa: E402
from .run_view import RunStatus, RunView  # noqa: E402
from .runs_table import RunsTable  # noqa: E402
from .ste_compare import SteCompareView  # noqa: E402
from .streaming import DISPLAY_CAP, RunStream, StreamHub  # noqa: E402
from .theme import SYSTEM_FONT, LocalFast, template_kwargs  # noqa: E402

__all__ = ["Dashboard", "ConfigPanel", "RunStatus", "RunView", "SteCompareView", "QuantView", "PhaseView",
           "RunsTable", "LiveView", "PlotOptions", "StreamHub", "RunStream", "DISPLAY_CAP", "DASHBOARDS",
           "LocalFast", "SYSTEM_FONT", "template_kwargs", "limit_blas_threads"]
