"""One sidebar field per Param: what is typed is parsed and checked where it is typed.

Numbers and lists are typed as text, so the box always shows what the user typed. The text is
parsed and checked against the Param's own bounds; only a value the config can hold is
assigned. Otherwise the config keeps its value and the field says why, naming the field and
its allowed range (``Learning rate: must be a number > 0 and <= 1000, got 0``). Selectors are
Selects, booleans Checkboxes. Changes made to the config from Python show in the widget.
"""
from __future__ import annotations

import math
import re

import panel as pn
import param

ERROR_STYLE = {"color": "#b00020", "font-size": "12px", "margin-top": "-4px"}
_INT_TEXT = re.compile(r"^[+-]?\d+$")


def _num(v) -> str:
    return str(v) if isinstance(v, int) else format(v, ".10g")


def range_text(p: param.Parameter) -> str:
    """The allowed range of a numeric Param in words, e.g. ``a whole number from 1 to 65536``."""
    kind = "a whole number" if isinstance(p, param.Integer) else "a number"
    lo, hi = p.bounds or (None, None)
    inc_lo, inc_hi = getattr(p, "inclusive_bounds", (True, True))
    if isinstance(p, param.Integer) and lo is not None and hi is not None and inc_lo and inc_hi:
        return f"{kind} from {_num(lo)} to {_num(hi)}"
    parts = []
    if lo is not None:
        parts.append(f"{'>=' if inc_lo else '>'} {_num(lo)}")
    if hi is not None:
        parts.append(f"{'<=' if inc_hi else '<'} {_num(hi)}")
    return f"{kind} {' and '.join(parts)}" if parts else kind


def _parse_int(text: str) -> int:
    if _INT_TEXT.match(text):
        return int(text)
    value = float(text)                        # "1e6" is a whole number too
    if not math.isfinite(value) or not value.is_integer():
        raise ValueError(text)
    return int(value)


def parse_number(p: param.Number, text: str):
    """``text`` as the Param's number type, inside its bounds; ``ValueError`` saying what is allowed."""
    allowed = range_text(p)
    text = text.strip()
    try:
        value = _parse_int(text) if isinstance(p, param.Integer) else float(text)
    except ValueError:
        raise ValueError(f"must be {allowed}, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"must be {allowed} (finite), got {text!r}")
    lo, hi = p.bounds or (None, None)
    inc_lo, inc_hi = getattr(p, "inclusive_bounds", (True, True))
    if (lo is not None and (value < lo or (value == lo and not inc_lo))) or \
       (hi is not None and (value > hi or (value == hi and not inc_hi))):
        raise ValueError(f"must be {allowed}, got {text}")
    return value


def parse_list(p: param.List, text: str) -> list:
    """Comma- or space-separated items (brackets optional) of the List's item type."""
    body = text.strip().strip("[]()").strip()
    body = body[:-1].rstrip() if body.endswith(",") else body          # (one trailing comma is fine)
    tokens = re.split(r"\s*,\s*|\s+", body) if body else []
    if "" in tokens:            # "1,2,,3": the box would show an item the config does not hold
        raise ValueError(f"an empty item between commas in {text.strip()!r}; write e.g. 256, 128")
    item = p.item_type
    out = []
    for tok in tokens:
        try:
            if item is int:
                if not _INT_TEXT.match(tok):
                    raise ValueError(tok)
                out.append(int(tok))
            elif item is float:
                out.append(float(tok))
            else:
                out.append(tok)
        except ValueError:
            what = "whole numbers" if item is int else "numbers"
            raise ValueError(f"must be {what} separated by commas (e.g. 256, 128), got {text.strip()!r}") from None
    return out


def as_text(p: param.Parameter, value) -> str:
    if isinstance(p, param.List):
        return ", ".join(_num(v) if isinstance(v, (int, float)) else str(v) for v in value or [])
    if isinstance(p, param.Number) and value is not None:
        return _num(value)
    return "" if value is None else str(value)


def supported(p: param.Parameter) -> bool:
    """Params a Field can show (nested configs and other objects are not fields)."""
    return isinstance(p, (param.Selector, param.Boolean, param.Number, param.List, param.String)) and \
        not isinstance(p, param.ClassSelector)


class Checked:
    """An error line under a widget: the part's own ``error`` and a ``rule_error`` (set by the
    panel when a rule spanning several fields names this part); ``message`` shows whichever is set.

    ``views`` are the part's widgets (without ``message``). The message pane is laid out by the
    panel only once it is first shown (each pane laid out is Bokeh models every page open builds
    and sends, and most fields never show an error)."""

    label = ""
    key = ""

    def _init_errors(self) -> None:
        self._visible = True
        self.error: str | None = None
        self.rule_error: str | None = None
        self._message = None    # the error pane, made on first use
        self.on_shown = None    # called with the part when its message or widgets show (the panel lays them out)

    @property
    def message(self) -> pn.pane.HTML:
        """The error line (CSS class ``qatlab-field-error``), hidden while there is no error."""
        if self._message is None:
            self._message = pn.pane.HTML("", visible=False, css_classes=["qatlab-field-error"], styles=ERROR_STYLE,
                                         sizing_mode="stretch_width", margin=(0, 10))
        return self._message

    @property
    def message_made(self) -> bool:
        """The error pane exists (the part has shown an error once)."""
        return self._message is not None

    @property
    def message_shown(self) -> bool:
        return self._message is not None and self._message.visible

    def _set_error(self, message: str | None) -> None:
        self.error = message
        self._show()

    def set_rule_error(self, message: str | None) -> None:
        if message != self.rule_error:
            self.rule_error = message
            self._show()

    @property
    def shown_error(self) -> str | None:
        return self.error or self.rule_error

    def _show(self) -> None:
        text = self.shown_error
        if text is None and self._message is None:
            return              # never had an error: nothing to hide
        self.message.object = "" if text is None else _html(text)
        self.message.visible = text is not None and self._visible
        if self.message.visible and self.on_shown is not None:
            self.on_shown(self)

    @property
    def visible(self) -> bool:
        """Shown in the page (the part applies to the current config)."""
        return self._visible

    @visible.setter
    def visible(self, value: bool) -> None:
        self._visible = bool(value)
        for view in self.views:
            view.visible = self._visible
        if self._visible and self.on_shown is not None:
            self.on_shown(self)
        self._show()


class Field(Checked):
    """Widget + inline error for ``obj.<name>``.

    Args:
        obj: the Param config holding the value; name: the parameter; label: the widget title
            (default: the Param's label); on_change: called after every edit (valid or not).

    ``error`` is the field's own message (unparsable, out of range) or None; ``rule_error`` a
    message from a rule spanning several fields that names this one (set by the panel).
    """

    def __init__(self, obj: param.Parameterized, name: str, label: str | None = None, on_change=None):
        self.obj, self.name = obj, name
        self.p = obj.param[name]
        self.label = label or self.p.label
        self.on_change = on_change
        self._init_errors()
        self._assigning = False
        self.widget = self._make_widget(getattr(obj, name))
        self._last_text = self.widget.value if isinstance(self.widget, pn.widgets.TextInput) else None
        self.views = [self.widget]   # laid out by the panel, with ``message`` (no wrapper: fewer models per page)
        self.typed = isinstance(self.widget, pn.widgets.TextInput) and not isinstance(self.p, param.String)
        if self.typed:
            self.widget.param.watch(self._on_text, "value_input")
            self.widget.param.watch(self._on_text, "value")
        else:
            self.widget.param.watch(self._on_value, "value")
        obj.param.watch(self._on_config, name)

    def _make_widget(self, value):
        common = dict(label=self.label, sizing_mode="stretch_width", description=self.p.doc)
        if isinstance(self.p, param.Boolean):
            return pn.widgets.Checkbox(value=bool(value), label=self.label, sizing_mode="stretch_width")
        if isinstance(self.p, param.Selector):
            return pn.widgets.Select(options=list(self.p.objects), value=value, **common)
        return pn.widgets.TextInput(value=as_text(self.p, value), **common)

    @property
    def key(self) -> str:
        return f"{type(self.obj).__name__}.{self.name}"

    def parse(self, text: str):
        if isinstance(self.p, param.Number):
            return parse_number(self.p, text)
        if isinstance(self.p, param.List):
            return parse_list(self.p, text)
        return text

    # ---------------------------------------------------------------- edits
    def _assign(self, value) -> None:
        self._assigning = True
        try:
            setattr(self.obj, self.name, value)
        finally:
            self._assigning = False

    def _on_text(self, event) -> None:
        if (event.new or "") != self._last_text:      # value_input per key, then value on Enter / blur
            self.set_text(event.new or "")

    def set_text(self, text: str) -> None:
        """Parse ``text`` as if typed; assign it when the config can hold it, else show why."""
        self._last_text = text
        try:
            value = self.parse(text)
            if value != getattr(self.obj, self.name):
                self._assign(value)
        except (ValueError, TypeError) as exc:
            self._set_error(f"{self.label}: {short_error(exc)}")
        else:
            self._set_error(None)
        if self.on_change is not None:
            self.on_change(self)

    def _on_value(self, event) -> None:
        try:
            self._assign(event.new)
        except (ValueError, TypeError) as exc:
            self._set_error(f"{self.label}: {short_error(exc)}")
        else:
            self._set_error(None)
        if self.on_change is not None:
            self.on_change(self)

    def revert(self) -> None:
        """Show the config's value again, dropping what was typed and its error (a field that no
        longer applies: its value is not used, and a hidden error could not be fixed)."""
        if self.typed:
            text = self._last_text = as_text(self.p, getattr(self.obj, self.name))
            self.widget.param.update(value=text, value_input=text)
        self._set_error(None)

    def _on_config(self, event) -> None:
        """The config changed from elsewhere (Python, a test): show its value, drop a stale error."""
        if self._assigning:
            return
        if self.typed:
            text = self._last_text = as_text(self.p, event.new)
            self.widget.param.update(value=text, value_input=text)
        else:
            self.widget.value = event.new
        self._set_error(None)
        if self.on_change is not None:
            self.on_change(self)


def short_error(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
