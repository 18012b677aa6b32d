"""The optional C parts (everything else is in pyproject.toml): the frame scanner's fast loop
and, on Linux, the relay thread and the plain-HTTP lane thread (epoll).

``optional=True``: without a C compiler the install still succeeds; ``balancer.frames`` then
uses its pure-Python loop (``balancer.frames.ACCELERATED`` says which one runs) and every
session is relayed by the event loop (``balancer.aio.offload.AVAILABLE``).
"""

import sys


from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "balancer._scan", ["balancer/_scan.c"], optional=True, extra_compile_args=["-O2"]
        ),
        *(
            [
                Extension(
                    "balancer._relay",
                    ["balancer/_relay.c"],
                    optional=True,
                    extra_compile_args=["-O2"],
                ),
                Extension(
                    "balancer._lanes",
                    ["balancer/_lanes.c"],
                    optional=True,
                    extra_compile_args=["-O2"],
                ),
            ]
            if sys.platform.startswith("linux")
            else []
        ),
    ]
)
