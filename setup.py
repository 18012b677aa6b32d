"""The optional C fast loop of the frame scanner (everything else is in pyproject.toml).

``optional=True``: without a C compiler the install still succeeds and ``balancer.frames``
uses its pure-Python loop (``balancer.frames.ACCELERATED`` says which one runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("balancer._scan", ["balancer/_scan.c"], optional=True, extra_compile_args=["-O2"])
    ]
)
