"""qatlab dashboard app: ``panel serve app/`` serves it at http://localhost:5006/app.

Composition only: one :class:`qatlab.ui.Dashboard` per session inside a FastListTemplate
whose fonts and CSS are all served locally (see :mod:`qatlab.ui.theme`). Runs train on Dask
workers (the local cluster, or ``QATLAB_SCHEDULER``) and are kept in the run store
(``QATLAB_STORE``). Environment: the sidebar lists the files of ``QATLAB_DATA_DIR`` (if set) and
keeps uploads under ``QATLAB_UPLOAD_DIR`` (default: a temporary directory per page); ``make
serve`` binds 127.0.0.1 (README, "Safety").
"""
import gc
import pathlib
import sys

import panel as pn

try:
    import qatlab  # noqa: F401  (installed with `pip install -e .`, as `make serve` does)
except ImportError:  # served from a plain checkout: the package sits next to app/
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from qatlab import warmup  # noqa: E402
from qatlab.executor import connect  # noqa: E402
from qatlab.ui import Dashboard, LocalFast, template_kwargs  # noqa: E402
from qatlab.ui.heap import tune_server_malloc  # noqa: E402

tune_server_malloc()   # before the cluster's and the runs' threads (qatlab.ui.heap); the same on every call

# Compile the kernels of the first runs into Numba's disk cache once, then start the workers, which
# load them from there. `panel serve --warm` (make serve) runs this file once before the server
# listens (no request headers then): wait there, so the first Start trains at once; a server started
# without --warm compiles in the background and connects on the first Start.
warmup.start()
if not pn.state.headers:
    warmup.wait()
    connect()
    # What exists now lives as long as the server: out of the collector's sight, a full collection
    # (Panel runs one each time a page's session ends) scans only the sessions' objects.
    gc.collect()
    gc.freeze()

# The page's components are made in the template's design: made in Panel's default one, each would
# change its stylesheets on its first update, and Bokeh re-walks the whole document for that.
pn.extension("tabulator", notifications=True, design=LocalFast)

dashboard = Dashboard()
pn.template.FastListTemplate(sidebar=[dashboard.sidebar], main=[dashboard.main], **template_kwargs()).servable()
