"""Data files from the page: uploads and the server's data directory, never a typed path (no browser)."""
from __future__ import annotations

import io
import os

import numpy as np
import pytest

pn = pytest.importorskip("panel")

from qatlab.ui import data_source  # noqa: E402
from qatlab.ui.config_panel import ConfigPanel  # noqa: E402


def npz_bytes(n: int = 40, d: int = 5, classes: int = 3, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    np.savez(buf, X=rng.normal(size=(n, d)).astype(np.float32), y=rng.integers(0, classes, n))
    return buf.getvalue()


def upload(panel: ConfigPanel, name: str, content: bytes) -> None:
    """As the browser's FileInput does: filename first, then the bytes."""
    w = panel.file_chooser.upload
    w.param.update(filename=name, mime_type="application/octet-stream", value=content)


@pytest.fixture
def panel(tmp_path, monkeypatch):
    monkeypatch.setenv(data_source.UPLOAD_DIR_ENV, str(tmp_path / "uploads"))
    p = ConfigPanel(data_dir=None)
    p.config.model.architecture = "mlp"      # the files here hold flat features (the page's default is a cnn)
    p.config.data.dataset = "file"
    return p


def test_no_typed_path_field(panel):
    assert "data.path" not in panel.fields
    assert not any(isinstance(f.widget, pn.widgets.TextInput) and f.name == "path" for f in panel.fields.values())
    assert panel.file_chooser.visible and not panel.file_chooser.choice.visible   # no data directory given
    assert panel.start_button.disabled and "Data file" in (panel.file_chooser.shown_error or "")


def test_upload_is_saved_and_used(panel, tmp_path):
    upload(panel, "my data.npz", npz_bytes())
    path = panel.config.data.path
    assert os.path.isfile(path) and os.path.realpath(path).startswith(str(tmp_path / "uploads"))
    assert panel.file_chooser.error is None and not panel.start_button.disabled
    shown = panel.file_chooser.using.object
    assert "my data.npz" in shown and str(tmp_path) not in shown    # the name, never a server path
    upload(panel, "<i>x.npz", npz_bytes(seed=3))
    assert "&lt;i&gt;x.npz" in panel.file_chooser.using.object          # shown as text
    assert panel.validated().data.path == panel.config.data.path != path


def test_bad_upload_shows_only_the_data_layers_message(panel):
    upload(panel, "ok.npz", npz_bytes())
    good = panel.config.data.path
    secret = b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
    upload(panel, "passwd.csv", secret)
    err = panel.file_chooser.error
    assert err and err.startswith("Data file: ") and "daemon" not in err and "root:" not in err
    assert panel.config.data.path == good           # the previous file stays set, but Start is refused
    assert panel.start_button.disabled and panel.validated() is None
    upload(panel, "notes.txt", b"hello")
    assert "filename" in panel.file_chooser.error and panel.start_button.disabled
    upload(panel, "again.npz", npz_bytes(seed=1))
    assert panel.file_chooser.error is None and not panel.start_button.disabled


def test_an_empty_file_is_refused_by_name(panel):
    upload(panel, "empty.csv", None)       # Panel gives an empty file no value: only its name changes
    assert panel.file_chooser.error == "Data file: empty.csv is empty" and panel.start_button.disabled
    upload(panel, "ok.npz", npz_bytes())
    assert panel.file_chooser.error is None and not panel.start_button.disabled
    upload(panel, "empty2.csv", None)
    assert "empty2.csv is empty" in panel.file_chooser.error and panel.start_button.disabled


def test_oversized_upload_is_refused_before_saving(panel, monkeypatch, tmp_path):
    monkeypatch.setattr(data_source, "UPLOAD_MAX_BYTES", 100)
    upload(panel, "big.npz", npz_bytes())
    assert "uploads up to" in panel.file_chooser.error and panel.start_button.disabled
    assert not (tmp_path / "uploads").exists() or not any((tmp_path / "uploads").rglob("*.npz"))


def test_data_directory_lists_and_resolves_its_files(tmp_path):
    data_dir = tmp_path / "data"
    (data_dir / "sub").mkdir(parents=True)
    (data_dir / "a.npz").write_bytes(npz_bytes())
    (data_dir / "sub" / "b.npz").write_bytes(npz_bytes(seed=2))
    outside = tmp_path / "secret.csv"
    outside.write_text("1,2,0\n")
    os.symlink(outside, data_dir / "link.csv")
    panel = ConfigPanel(data_dir=str(data_dir))
    panel.config.model.architecture = "mlp"
    panel.config.data.dataset = "file"
    chooser = panel.file_chooser
    assert chooser.choice.visible and chooser.choice.options == [data_source.NONE, "a.npz", "sub/b.npz"]
    chooser.choice.value = "sub/b.npz"
    assert panel.config.data.path == str((data_dir / "sub" / "b.npz").resolve())
    assert not panel.start_button.disabled and "sub/b.npz" in chooser.using.object
    chooser.choice.options = [*chooser.choice.options, "../secret.csv"]    # a name the page never listed
    chooser.choice.value = "../secret.csv"
    assert chooser.error and "secret" not in panel.config.data.path and panel.start_button.disabled
