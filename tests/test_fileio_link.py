"""fileio.link_or_copy: one copy on disk where the file system allows, a copy where not; and
neither name's contents change when the other is written over (every write renames a new file)."""
from __future__ import annotations

import errno
import os

from voodoo_quant.core import fileio


def test_link_shares_the_file_and_a_later_write_leaves_the_other_name_alone(tmp_path):
    src = fileio.write_bytes(tmp_path / "a" / "h.bin", b"first")
    dst = fileio.link_or_copy(src, tmp_path / "b" / "h.bin")
    assert dst.read_bytes() == b"first"
    assert dst.stat().st_ino == src.stat().st_ino  # a hard link: no second copy
    fileio.write_bytes(dst, b"second")  # atomic: a new file renamed over the link
    assert src.read_bytes() == b"first" and dst.read_bytes() == b"second"
    fileio.link_or_copy(src, dst)  # over an existing target, too
    assert dst.read_bytes() == b"first"
    assert not [p for p in dst.parent.iterdir() if p.name.endswith(fileio.TMP_SUFFIX)]


def test_without_hard_links_it_copies(tmp_path, monkeypatch):
    def no_link(*_a, **_k):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    src = fileio.write_bytes(tmp_path / "h.bin", b"x" * 4096)
    dst = fileio.link_or_copy(src, tmp_path / "c" / "h.bin")
    assert dst.read_bytes() == src.read_bytes() and dst.stat().st_ino != src.stat().st_ino
    assert not [p for p in dst.parent.iterdir() if p.name.endswith(fileio.TMP_SUFFIX)]
