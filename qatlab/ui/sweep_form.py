"""What the Sweeps tab's form holds, read into a Sweep's arguments: axes, seeds, and the STE preset.

Axes are typed one per line, ``field = values``: ``quant.ste = identity, hard_tanh`` (comma-separated
words and numbers) or a JSON list ``quant.weight_bits = [2, 4, 8]`` (needed for list values such as
``model.hidden = [[32], [64, 32]]``). Seeds are ``0, 1, 2`` or a range ``0-3``. Errors are
``ValueError`` s naming the line or the field; the fields and values themselves are checked by
:class:`~qatlab.sweep.Sweep`.
"""
from __future__ import annotations

import ast
import json

from ..quant.ste import SteKind

MAX_SEEDS = 100
#: Fields the page never takes (a server file path): data comes by upload, in the sidebar.
PAGE_REFUSED = {"data.path": "the page never takes a server file path; upload the data in the sidebar "
                             "(Dataset = file)"}


def _item(text: str):
    """One comma-separated value: a Python literal (number, True, None, quoted text) or the word itself."""
    text = text.strip()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_axes(text: str) -> dict:
    """``{dotted field: [values]}`` from the axes text (blank lines and ``#`` comments skipped)."""
    if not isinstance(text, str):
        raise TypeError(f"axes: expected text, got {type(text).__name__}")
    grid: dict = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        field, sep, values = line.partition("=")
        field, values = field.strip(), values.strip()
        if not sep or not field or not values:
            raise ValueError(f"axes line {n}: expected 'field = value, value' such as "
                             f"'quant.ste = identity, hard_tanh'; got {line!r}")
        if field in PAGE_REFUSED:
            raise ValueError(f"axes line {n}: {field}: {PAGE_REFUSED[field]}")
        if values.startswith("["):
            try:
                parsed = json.loads(values)
            except json.JSONDecodeError as exc:
                raise ValueError(f"axes line {n} ({field}): not a JSON list: {exc.msg}") from None
            if not isinstance(parsed, list):
                raise ValueError(f"axes line {n} ({field}): expected a list of values")
        else:
            parsed = [_item(v) for v in values.split(",")]
            if any(v == "" for v in parsed):
                raise ValueError(f"axes line {n} ({field}): an empty value in {values!r}")
        if not parsed:
            raise ValueError(f"axes line {n} ({field}): expected at least one value")
        if field in grid:
            raise ValueError(f"axes line {n}: field {field!r} is given twice")
        grid[field] = parsed
    return grid


def parse_seeds(text: str) -> list[int]:
    """Seeds from ``"0, 1, 2"`` or ``"0-3"`` (both ends included); at most :data:`MAX_SEEDS`."""
    if not isinstance(text, str):
        raise TypeError(f"seeds: expected text, got {type(text).__name__}")
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            values = range(int(lo), int(hi) + 1) if dash else [int(part)]
        except ValueError:
            raise ValueError(f"seeds: expected whole numbers such as '0, 1, 2' or a range '0-3', got {part!r}") from None
        if not values:
            raise ValueError(f"seeds: the range {part!r} is empty; write it low-high, such as '0-3'")
        if len(seeds) + len(values) > MAX_SEEDS:      # (before a range is built: '0-1000000000')
            raise ValueError(f"seeds: at most {MAX_SEEDS} seeds, got {len(seeds) + len(values)}")
        seeds += values
    if not seeds:
        raise ValueError("seeds: expected at least one seed, such as '0' or '0, 1, 2'")
    return seeds


def axes_text(grid: dict) -> str:
    """The axes text of ``grid`` (what :func:`parse_axes` reads back)."""
    lines = []
    for field, values in grid.items():
        if all(isinstance(v, str) and "," not in v for v in values):
            lines.append(f"{field} = {', '.join(values)}")
        else:
            lines.append(f"{field} = {json.dumps(values)}")
    return "\n".join(lines)


def ste_grid() -> dict:
    """The "Compare STE kinds" preset: one axis over every STE kind."""
    return {"quant.ste": [k.value for k in SteKind]}
