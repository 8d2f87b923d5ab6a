"""Doctests of the fxaccum package: their temporary directories go under pytest's tmp_path."""

import tempfile

import pytest


@pytest.fixture(autouse=True)
def _doctest_tempdir(request, monkeypatch):
  # Docstring examples call tempfile.mkdtemp() (runnable as written); here it is cleaned up.
  if isinstance(request.node, pytest.DoctestItem):
    monkeypatch.setattr(tempfile, "tempdir", str(request.getfixturevalue("tmp_path")))
