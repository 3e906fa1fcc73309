"""Build of the compiled fast path (patcher/_speedups.c); everything else is in pyproject.toml.

The extension is optional: where no C compiler is found the build goes on without it and
the NumPy codec runs instead (same results, slower). BULLETIN_REQUIRE_NATIVE=1 makes a
failed compile fail the install (scripts/test.sh sets it, so CI never tests without it).
"""

import os
import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]
libraries = [] if sys.platform == "win32" else ["m"]  # log2, for the window choice

setup(
    ext_modules=[
        Extension(
            "patcher._speedups",
            ["patcher/_speedups.c"],
            # The stable ABI of 3.11: one build serves every later CPython.
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            py_limited_api=True,
            extra_compile_args=flags,
            libraries=libraries,
            optional=os.environ.get("BULLETIN_REQUIRE_NATIVE") != "1",
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
