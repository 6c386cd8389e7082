"""Sweeps: runs over grid/random values of config fields times seeds on the Dask executor.

:class:`Sweep` (:mod:`.runner`) expands and checks the points (:mod:`.points`) and runs them;
:class:`SweepResult` (:mod:`.result`) gives the table, the per-point summary and ``best()``;
:class:`MedianStopping` (:mod:`.pruning`) is the optional early-stopping rule.
"""
from .points import Point, config_diff, config_key, expand, flat_fields, set_field
from .pruning import MedianStopping
from .result import SweepResult
from .runner import Sweep, SweepHandle

__all__ = ["MedianStopping", "Point", "Sweep", "SweepHandle", "SweepResult", "config_diff", "config_key", "expand",
           "flat_fields", "set_field"]
