"""Hand-written CUDA C++ (kernel templates and the runtime), shipped as package data.

This file exists only so the sources install as ``stitch_backend.csrc``; locate them
with ``importlib.resources.files("stitch_backend.csrc")``.
"""
