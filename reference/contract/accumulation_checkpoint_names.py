"""The names a ZeroEngine checkpoint directory reserves for itself, and which tags are therefore allowed.

Shared by every implementation of ``save_checkpoint`` / ``load_checkpoint`` and by the conformance suite because
the layout is a contract (docs/zero.md, "Checkpoints: what is guaranteed"): ``<dir>/<tag>/`` holds a checkpoint,
``<dir>/latest`` is the file naming the newest tag, ``<dir>/latest.tmp`` is that file before its commit, and the
hidden ``<dir>/.<tag>.partial/`` and ``<dir>/.<tag>.old/`` are a save's staging and rollback directories. A tag
equal to one of those names would make a save overwrite the pointer (``tag="latest"`` replaced the ``latest`` file
with a directory, and the next ``load_checkpoint(dir)`` could not resume) or be swept as a stale leftover, so
:func:`check_tag` refuses it before anything is written, whatever ``save_latest`` says.
"""

from __future__ import annotations

import os

from reference.contract.errors import ConfigurationError

__all__ = ["LATEST", "LATEST_STAGING", "RESERVED_TAGS", "check_tag"]

#: The file naming the newest tag (DeepSpeed's convention).
LATEST = "latest"
#: ``latest`` as written before the commit renames it into place.
LATEST_STAGING = LATEST + ".tmp"
#: Names in a checkpoint directory that are never a tag (hidden names, the staging and rollback directories
#: included, are refused by :func:`check_tag` too).
RESERVED_TAGS = (LATEST, LATEST_STAGING)


def check_tag(tag: object) -> str:
    """``tag`` if it can name a checkpoint directory, else a :class:`ConfigurationError` naming what is allowed.

    Why each rule: a path separator, ``.``/``..`` or a leading ``.`` would leave ``save_dir`` or collide with the
    hidden staging names; NUL is in no file name (the OS layer raised a bare ``ValueError``); leading or trailing
    whitespace is invisible in listings and in ``latest``, and a load from a hand-edited ``latest`` cannot tell it
    from the line ending (``tag='run1 '`` saved, and the load from ``latest`` then looked for ``'run1'``); and a
    reserved name in another case (``'LATEST'``) is the reserved file itself on a case-insensitive filesystem."""
    if not isinstance(tag, str) or not tag or tag in (".", "..") or os.sep in tag or tag.startswith("."):
        raise ConfigurationError(
            f"tag={tag!r} must be a non-empty str without path separators that does not start with '.'"
        )
    if "\x00" in tag:
        raise ConfigurationError(
            f"tag={tag!r} contains a NUL character, which no file name may hold; allowed: a name without it"
        )
    if tag != tag.strip():
        raise ConfigurationError(
            f"tag={tag!r} starts or ends with whitespace, which a tag may not (it would not survive the 'latest' "
            f"file unchanged); allowed: the name without it, e.g. {tag.strip() or 'global_step<N>'!r}"
        )
    if tag.casefold() in RESERVED_TAGS:
        raise ConfigurationError(
            f"tag={tag!r} is reserved by the checkpoint directory's layout (reserved, in any letter case: "
            f"{', '.join(repr(n) for n in RESERVED_TAGS)}; '.'-prefixed names are the staging directories); "
            f"allowed: any other non-empty name, e.g. 'global_step<N>'"
        )
    return tag
