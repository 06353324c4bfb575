"""The relay's compiled hot path (cdc/wal/_pgfast.c), declared for setuptools.

Everything else about the package is in pyproject.toml. The extension is declared
here because setuptools still calls ``[tool.setuptools.ext-modules]`` experimental
and says so (a BuildBackendWarning, three times per install). Built where a C
compiler is present, skipped where not (``optional``): cdc.wal.pgoutput falls back
to pure Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("cdc.wal._pgfast", sources=["cdc/wal/_pgfast.c"], optional=True)])
