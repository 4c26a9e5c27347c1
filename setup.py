"""The compiled kernels (pdserve/kernels/*.c). Everything else is in pyproject.toml.

The extension is optional: where it cannot be compiled (no C compiler, another CPU
architecture) the install still succeeds and pdserve runs without it (slower; see
pdserve/kernels/__init__.py). It needs only the Python headers, not torch's.
"""

import platform

from setuptools import Extension, setup

ext_modules = []
if platform.machine().lower() in ("x86_64", "amd64"):
    ext_modules.append(
        Extension(
            "pdserve.kernels._kernels",
            sources=[
                "pdserve/kernels/_bindings.c",
                "pdserve/kernels/_kernels.c",
                "pdserve/kernels/_attention.c",
                "pdserve/kernels/_int8.c",
                "pdserve/kernels/_dense.c",
            ],
            depends=["pdserve/kernels/_kernels.h"],
            # -ffp-contract=off: the kernel's FMAs are explicit, so every tile shape
            # rounds the same way (batch invariance, see _kernels.c's header).
            extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off", "-std=gnu11"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
