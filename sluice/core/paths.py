"""One file path and one import path per module, though links map the checkout's folders into
sluice (sluice/server -> ../server, ...): a linked package is loaded from the folder the link
names, so tracebacks and logs name a file as git and ruff do, and by its sluice name only."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType


class LinkedFolders(MetaPathFinder):
    """Finds sluice.X, where sluice/X is a link, in the folder it names (a wheel has none)."""

    @staticmethod
    def find_spec(
        name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        parent, _, leaf = name.rpartition(".")
        if parent != "sluice" or path is None:  # every other import: the usual finders
            return None
        for entry in path:
            folder = os.path.join(entry, leaf)
            if os.path.islink(folder):
                real = os.path.realpath(folder)
                init = os.path.join(real, "__init__.py")
                return importlib.util.spec_from_file_location(
                    name, init, submodule_search_locations=[real]
                )
        return None


def install() -> None:
    if LinkedFolders not in sys.meta_path:
        sys.meta_path.insert(0, LinkedFolders)


def sole_name(name: str, expected: str) -> None:
    """Refuse a linked package imported by another name than its own (the checkout's server/
    as a top-level `server`: a second module of each file)."""
    if name != expected:
        folder = expected.rsplit(".", 1)[-1]
        raise ImportError(f"the checkout's {folder}/ is the package {expected}: import that")
