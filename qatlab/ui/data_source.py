"""Where a ``dataset="file"`` run's data comes from in the page: an upload or the server's data directory.

The page never takes a typed server path. An upload (``FileInput``; .npz / .csv / .csv.gz, at
most :data:`UPLOAD_MAX_BYTES`, the data layer's cap) is saved by :func:`qatlab.data.save_upload` into a directory of
this page; a file of the directory the server was started with (``QATLAB_DATA_DIR``) is chosen
from a list and resolved by :func:`qatlab.data.resolve_data_file` (which refuses names that leave
it). Either sets ``DataConfig.path``. A file over the cap is refused in the browser before it is read
(:class:`UploadGuard`), since a message larger than the websocket's limit would close the page. The page shows only the file's name, and an error shows only
the data layer's own one-line message (never file contents, never a server path).
"""
from __future__ import annotations

import html
import logging
import os
import tempfile
from pathlib import Path

import panel as pn
import param

from .. import data as qdata
from .fields import Checked, short_error

log = logging.getLogger(__name__)

# A FileInput sends the file base64-encoded in one websocket message: `make serve` raises Bokeh's
# 20 MiB message limit to WEBSOCKET_MAX_BYTES so that an upload of UPLOAD_MAX_BYTES fits.
UPLOAD_MAX_BYTES = qdata.MAX_UPLOAD_BYTES
WEBSOCKET_MAX_BYTES = 32 * 2**20
ACCEPT = ".npz,.csv,.gz"
DATA_DIR_ENV = qdata.DATA_DIR_ENV
UPLOAD_DIR_ENV = "QATLAB_UPLOAD_DIR"
NONE = "(none)"


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


class UploadGuard(pn.custom.JSComponent):
    """Refuses a file over ``limit`` bytes in the browser, before it is read and sent (a message that
    large would close the page's websocket): a capturing ``input`` listener empties the file input and
    reports ``"<name>|<bytes>|<time>"`` in ``refused``."""

    limit = param.Integer(default=0)
    refused = param.String(default="")

    _esm = """
    export function render({ model }) {
      window.__qatlab_upload_guard = model;
      if (!window.__qatlab_upload_listener) {
        window.__qatlab_upload_listener = true;
        window.addEventListener("input", (event) => {
          const el = event.composedPath()[0];
          const guard = window.__qatlab_upload_guard;
          if (!guard || !el || el.type !== "file" || !el.files) return;
          const big = Array.from(el.files).find((f) => f.size > guard.limit);
          if (big) {
            el.value = "";
            guard.refused = `${big.name}|${big.size}|${Date.now()}`;
          }
        }, true);
      }
      return document.createElement("span");
    }
    """


class DataFileChooser(Checked):
    """Upload + data-directory list that set ``config.path``; shown while ``dataset == "file"``.

    Args:
        config: the session's DataConfig.
        data_dir: the server's data directory (default ``$QATLAB_DATA_DIR``; None: no list shown).
        on_change: called after every choice (valid or not).
    """

    label = "Data file"
    key = "DataConfig.path"

    def __init__(self, config, data_dir: str | None = None, on_change=None):
        self.config = config
        self.data_dir = data_dir if data_dir is not None else (os.environ.get(DATA_DIR_ENV) or None)
        self.on_change = on_change
        self._init_errors()
        self._upload_dir: Path | None = None
        self._source = ""          # what the page shows as the file in use (a name, never a path)
        self.upload = pn.widgets.FileInput(accept=ACCEPT, multiple=False, sizing_mode="stretch_width",
                                           label="Upload data", css_classes=["qatlab-upload"])
        self.upload.param.watch(self._on_upload, ["value", "filename"])   # (an empty file changes only the name)
        self.guard = UploadGuard(limit=UPLOAD_MAX_BYTES, height=0, width=0, margin=0)
        self.guard.param.watch(self._on_refused, "refused")
        names = self._listing()
        self.choice = pn.widgets.Select(label="Server data directory", options=[NONE, *names], value=NONE,
                                        visible=self.data_dir is not None, sizing_mode="stretch_width")
        self.choice.param.watch(self._on_choice, "value")
        self.using = pn.pane.HTML("", css_classes=["qatlab-data-file"], sizing_mode="stretch_width", margin=(0, 10))
        hint = (f"Upload a .npz (X, y[, X_test, y_test]) or a .csv (label last), up to {_mb(UPLOAD_MAX_BYTES)}"
                + (", or choose a file the server offers." if self.data_dir else "."))
        self.box = pn.Column(pn.pane.HTML(f"<small>{hint}</small>", margin=(0, 10)), self.upload, self.choice,
                             self.using, self.guard, sizing_mode="stretch_width", margin=0)
        self.views = [self.box]
        self.show_using()

    def _listing(self) -> list[str]:
        if self.data_dir is None:
            return []
        try:
            return list(qdata.list_data_files(self.data_dir))
        except (ValueError, OSError) as exc:
            log.warning("qatlab: cannot list %s=%s: %s", DATA_DIR_ENV, self.data_dir, exc)
            return []

    def _dest(self) -> Path:
        if self._upload_dir is None:
            base = os.environ.get(UPLOAD_DIR_ENV) or None
            if base is not None:
                os.makedirs(base, exist_ok=True)
            self._upload_dir = Path(tempfile.mkdtemp(prefix="qatlab-upload-", dir=base))
        return self._upload_dir

    # ---------------------------------------------------------------- choices
    def _on_upload(self, *_events) -> None:
        content, name = self.upload.value, os.path.basename(self.upload.filename or "upload")
        if content is None:
            if self.upload.filename:     # Panel gives an empty file no value
                self._refuse(f"{self.label}: {name} is empty")
            return
        if len(content) > UPLOAD_MAX_BYTES:
            self._refuse(f"{self.label}: {name} is {_mb(len(content))}; uploads up to {_mb(UPLOAD_MAX_BYTES)} "
                         "are accepted")
            return
        try:
            path = qdata.save_upload(name, content, self._dest())
        except (ValueError, TypeError) as exc:        # the data layer's one-line message, nothing else
            self._refuse(f"{self.label}: {short_error(exc)}")
            return
        except OSError:
            log.exception("qatlab: saving an upload failed")
            self._refuse(f"{self.label}: the server could not save {name}")
            return
        self._use(path, f"upload {name}")

    def _on_refused(self, event) -> None:
        name, size, _ = (event.new.rsplit("|", 2) + ["", ""])[:3]
        size = int(size) if size.isdigit() else 0
        self._refuse(f"{self.label}: {os.path.basename(name)} is {_mb(size)}; uploads up to "
                     f"{_mb(UPLOAD_MAX_BYTES)} are accepted")

    def _on_choice(self, event) -> None:
        if event.new == NONE:
            return
        try:
            path = qdata.resolve_data_file(self.data_dir, event.new)
        except (ValueError, TypeError, OSError) as exc:
            self._refuse(f"{self.label}: {short_error(exc)}")
            return
        self._use(path, f"server file {event.new}")

    def _use(self, path, source: str) -> None:
        self._source = source
        self.config.path = str(path)
        self._set_error(None)
        self.show_using()
        if self.on_change is not None:
            self.on_change(self)

    def _refuse(self, message: str) -> None:
        self._set_error(message)
        if self.on_change is not None:
            self.on_change(self)

    def show_using(self) -> None:
        """Say which file the config uses (or that none is chosen yet)."""
        if self.config.path and self._source:
            self.using.object = f"<small>Using {html.escape(self._source)}</small>"
        elif self.config.path:
            self.using.object = f"<small>Using {html.escape(Path(self.config.path).name)} (set from Python)</small>"
        else:
            self.using.object = "<small>No file chosen yet.</small>"
