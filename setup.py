"""Package list for setuptools (the rest of the metadata is in pyproject.toml).

`deepinfer_kernels` is the folder kernels/ (mapped in pyproject's package-dir);
setuptools' find cannot rename a folder, so the packages are listed here."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["deepinfer*"])
      + [f"deepinfer_kernels{p[len('kernels'):]}" for p in find_packages(include=["kernels", "kernels.*"])])
