"""Output paths checked before any work: a run of minutes or hours must not end in "Is a directory".

Every command that writes a file (``--out``, ``--json``, ``--plot``) or a folder checks it when it starts:
a file path must not be a folder, an image path must end in an extension PIL can write; a folder path
must not be a file. For both, the nearest existing ancestor must be a writable folder, and missing folders
are created (``--out cats/cat.png`` makes ``cats/``, as ``mkdir -p`` would; folder outputs are made by
``save_pretrained`` and the trainers). Each failure is a ``ValueError`` naming the flag, the path and what
was expected.
"""

from __future__ import annotations

import os
from typing import Optional

from vispec.checks import writable_ancestor


def image_extensions() -> dict[str, str]:
    """Lower-case file extensions PIL can write, mapped to their format (``".png": "PNG"``)."""
    from PIL import Image

    Image.init()
    return {ext: fmt for ext, fmt in Image.registered_extensions().items() if fmt in Image.SAVE}


def check_output_file(path: Optional[str], flag: str, *, image: bool = False) -> Optional[str]:
    """``path`` if a file can be written there (module docstring); ``None`` passes through (no output asked)."""
    if path is None:
        return None
    if not path:
        raise ValueError(f"{flag} is empty; expected a file name")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a folder; expected a file name in it, e.g. "
                         f"{os.path.join(path, 'image.png' if image else 'result.json')!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path!r}: the file exists and is not writable")
    if image:
        ext = os.path.splitext(path)[1].lower()
        allowed = image_extensions()
        if ext not in allowed:
            common = ", ".join(e for e in (".png", ".jpg", ".webp", ".bmp", ".tiff") if e in allowed)
            raise ValueError(f"{flag} {path!r} does not end in an image extension PIL can write; expected e.g. {common}")
    _writable_ancestor(folder, flag, path)
    os.makedirs(folder, exist_ok=True)  # the checks passed: make the missing folders (mkdir -p)
    return path


def _writable_ancestor(folder: str, flag: str, path: str) -> str:
    """The nearest existing ancestor of ``folder``, where folders can be made and written
    (:func:`vispec.checks.writable_ancestor`)."""
    return writable_ancestor(folder, flag, path)


def check_output_folder(path: Optional[str], flag: str) -> Optional[str]:
    """``path`` if a folder can be written there (module docstring); ``None`` passes through."""
    if path is None:
        return None
    if not path:
        raise ValueError(f"{flag} is empty; expected a folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a file; expected a folder")
    _writable_ancestor(path, flag, path)
    return path
