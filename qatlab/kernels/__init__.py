"""Numba kernels: pure functions over float32 arrays with explicit out= buffers."""
