"""Griffe extension for the docs build: docstrings written for ``help()`` render well.

* fxaccum's docstrings use reST roles (``:class:`fxaccum.Weighted```, ``:func:`accumulate```).
  mkdocstrings renders Markdown, where a role would show up as literal text; each role
  becomes an *optional* mkdocs-autorefs reference: a link when the target is documented on
  the site, plain code otherwise (no warning either way).
* A Google-style ``Example:`` section is read by griffe as an admonition whose ``>>>`` lines
  Markdown turns into nested block quotes; ``Examples:`` is parsed into highlighted
  ``pycon`` code blocks. The section header is renamed for rendering only.

Not part of the package; loaded by mkdocs.yml only. The docstrings themselves are unchanged.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc):`~?([\w.]+)(?:\(\))?`")
_EXAMPLE_HEADER = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ReadableDocstrings(griffe.Extension):
  """Rewrites roles and ``Example:`` headers in every docstring of the loaded package."""

  def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
    self._visit(pkg, set())

  def _visit(self, obj: griffe.Object, seen: set[str]) -> None:
    if obj.path in seen:
      return
    seen.add(obj.path)
    if obj.docstring is not None:
      value = _ROLE.sub(lambda m: _reference(obj, m.group(1)), obj.docstring.value)
      obj.docstring.value = _EXAMPLE_HEADER.sub(r"\1Examples:", value)
    for member in obj.members.values():
      if not member.is_alias:
        self._visit(member, seen)


def _reference(obj: griffe.Object, target: str) -> str:
  try:
    identifier = obj.resolve(target) if "." not in target else target
  except Exception:  # noqa: BLE001 - an unknown name stays plain code
    identifier = target
  return f'<autoref identifier="{identifier}" optional><code>{target}</code></autoref>'
