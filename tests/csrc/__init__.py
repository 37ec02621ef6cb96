"""Tests of the hand-written CUDA C++ in csrc/ and its Python bindings (toolchain, driver, runtime)."""
