"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

* The API reference: vispec is one import root over several top-level folders (``models/`` is ``vispec.models``,
  ``pipelines/`` is ``vispec.pipelines``, ... by ``pyproject.toml``'s ``package-dir``), which griffe (mkdocstrings'
  loader) cannot follow. On import this module lays out ``.mkdocs-api/vispec/`` as the installed package looks:
  links to ``vispec/``'s entries and to the mapped folders; mkdocstrings reads the sources there (``paths``).
* The CLI reference: :func:`vispec.cli.reference.on_page_markdown` fills the page marked for it.
"""

from __future__ import annotations

import os
import pathlib
import tomllib

from vispec.cli.reference import on_page_markdown  # noqa: F401  (the hook MkDocs calls)

ROOT = pathlib.Path(__file__).resolve().parent
TREE = ROOT / ".mkdocs-api"


def _package_tree() -> None:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = TREE / "vispec"
    package.mkdir(parents=True, exist_ok=True)
    links = {entry.name: entry for entry in (ROOT / "vispec").iterdir()}
    links.update({name.split(".", 1)[1]: ROOT / folder for name, folder in mapping.items() if name.startswith("vispec.")})
    for name, target in links.items():
        link = package / name
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target)


_package_tree()
