"""The compiled kernels (pdserve/quant/_kernels.c). Everything else is in pyproject.toml.

The extension is optional: where it cannot be compiled (no C compiler, another CPU
architecture) the install still succeeds and pdserve runs without it (slower; see
pdserve/quant/kernels.py). It needs only the Python headers, not torch's.
"""

import platform

from setuptools import Extension, setup

ext_modules = []
if platform.machine().lower() in ("x86_64", "amd64"):
    ext_modules.append(
        Extension(
            "pdserve.quant._kernels",
            sources=["pdserve/quant/_kernels.c", "pdserve/quant/_attention.c", "pdserve/quant/_int8.c"],
            depends=["pdserve/quant/_kernels.h"],
            # -ffp-contract=off: the kernel's FMAs are explicit, so every tile shape
            # rounds the same way (batch invariance, see the file's header).
            extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off", "-std=gnu11"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
