"""Builds the optional native helper (aiokv/backends/cuda/_native*.c) with the system C
compiler. It needs no CUDA toolkit. Without a compiler (or when the build fails) the
install still succeeds and aiokv uses its pure-Python submit path (``aiokv info`` says
which). The disk tier's optional native reader (aiokv/cache/tiers/_diskread.c, zlib's
headers needed) is built the same way; without it the tier reads from Python. Everything
else about the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "aiokv.backends.cuda._native",
            sources=["aiokv/backends/cuda/_native.c", "aiokv/backends/cuda/_native_waiter.c",
                     "aiokv/backends/cuda/_native_issuer.c", "aiokv/backends/cuda/_native_plan.c"],
            depends=["aiokv/backends/cuda/_native.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "aiokv.cache.tiers._diskread",
            sources=["aiokv/cache/tiers/_diskread.c"],
            libraries=["z"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
    ]
)
