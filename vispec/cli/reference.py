"""The command-line reference, generated from the argument parsers themselves (so it cannot drift from them).

:func:`markdown` renders every command's ``--help`` (lazy trainer subcommands built too) as one Markdown page;
:func:`on_page_markdown` is the MkDocs hook (``mkdocs.yml``: ``hooks``) that puts it where a page has the marker
``<!-- vispec-cli-reference -->``. ``python -m vispec.cli.reference`` prints it.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Iterator

MARKER = "<!-- vispec-cli-reference -->"
WIDTH = 100  # help text wrapped as on a 100-column terminal, whatever the building machine's terminal


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("vispec",)
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """``(command words, parser)`` for the parser and every subcommand below it, depth first, in declared order."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            builders = getattr(action, "_builders", {})
            for name, sub in action._name_parser_map.items():
                build = builders.pop(name, None)  # a lazily built subcommand (a trainer's flags): build it now
                if build is not None:
                    build(sub)
                yield from commands(sub, path + (name,))


def help_text(parser: argparse.ArgumentParser) -> str:
    """``parser``'s ``--help`` at :data:`WIDTH` columns, in the parser's own formatter class."""
    parser.formatter_class = functools.partial(parser.formatter_class, width=WIDTH)
    return parser.format_help().rstrip()


def markdown() -> str:
    """The reference page's body: one section per command, its ``--help`` verbatim."""
    from vispec.cli import build_parser

    sections = []
    for path, parser in commands(build_parser()):
        level = "#" * min(len(path) + 1, 4)
        sections.append(f"{level} `{' '.join(path)}`\n\n```text\n{help_text(parser)}\n```\n")
    return "\n".join(sections)


def on_page_markdown(text: str, **_: Any) -> str:
    """MkDocs hook: the generated reference in place of :data:`MARKER`."""
    return text.replace(MARKER, markdown()) if MARKER in text else text


if __name__ == "__main__":
    print(markdown())
