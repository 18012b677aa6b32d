"""The optional C parts (everything else is in pyproject.toml): the frame scanner's fast loop
and, on Linux, the offload thread (epoll) that relays streamed sessions and serves plain-HTTP
lanes.

``optional=True``: without a C compiler the install still succeeds; ``balancer.frames`` then
uses its pure-Python loop (``balancer.frames.ACCELERATED`` says which one runs) and every
session is relayed by the event loop (``balancer.aio.offload.AVAILABLE``).

The offload thread parses HTTP with llhttp, whose C sources are fetched and proven at build time
(``tools/llhttp_src.py``: pinned, cached outside the checkout, never copied into the repository
or the sdist) and compiled into it. Where they cannot be had, that module is left out, as without
a compiler.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))

LLHTTP_USERS = ("balancer._offload",)


class BuildExt(build_ext):
    """build_ext that compiles llhttp's fetched sources once and links them into its users."""

    def build_extensions(self) -> None:
        users = [e for e in self.extensions if e.name in LLHTTP_USERS]
        if users:
            try:
                import llhttp_src

                src = str(llhttp_src.sources())
                sources = [os.path.join(src, name) for name in llhttp_src.SOURCES]
                objects = self.compiler.compile(
                    sources,
                    output_dir=os.path.join(self.build_temp, "llhttp"),
                    include_dirs=[src],
                    extra_postargs=["-O2", "-fvisibility=hidden"],  # its own, not exported
                )
            except Exception as e:  # ImportError, llhttp_src.Unavailable, CompileError
                print(f"warning: building without {', '.join(LLHTTP_USERS)}: {e}", file=sys.stderr)
                self.extensions = [x for x in self.extensions if x not in users]
            else:
                for ext in users:  # a newer llhttp (its sources: depends) relinks them
                    ext.include_dirs.append(src)
                    ext.extra_objects.extend(objects)
                    ext.depends.extend([*sources, os.path.join(src, "llhttp.h")])
        super().build_extensions()


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "balancer._scan", ["balancer/_scan.c"], optional=True, extra_compile_args=["-O2"]
        ),
        *(
            [
                Extension(
                    "balancer._offload",
                    ["balancer/_offload.c"],
                    optional=True,
                    extra_compile_args=["-O2"],
                ),
            ]
            if sys.platform.startswith("linux")
            else []
        ),
    ],
)
