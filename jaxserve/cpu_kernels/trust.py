"""Whether a built kernel library may be loaded: loading a shared library runs its code in this process, so a library
(or a directory to build one in) that another user could have written or replaced is never loaded.

A path is private when it and every directory above it are owned by this user or root and writable by neither group
nor others, a sticky directory aside (/tmp: there others cannot rename or remove what is not theirs). A group-writable
cache (umask 002) or one shared between users is not: jaxserve builds in a private temporary directory instead.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path


def why_untrusted(path: Path) -> str | None:
    """Why another user could have written path (a library or a directory), or None where only this user and root
    could; OSError where it cannot be looked at."""
    me = os.geteuid()
    resolved = path.resolve()  # a symbolic link is judged by where it leads (the links themselves: see the chain)
    for p in (resolved, *resolved.parents):
        st = p.stat()
        if st.st_uid not in (me, 0):
            return f"{p} is owned by another user (uid {st.st_uid})"
        sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_dir:
            return f"{p} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'}"
    return None
