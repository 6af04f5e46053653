"""A raw lake with what issue 24's new user had: symbolic links of every kind, hidden files,
copies of one image under several keys, and image formats beyond JPEG and PNG."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.lake import encode, make_image, write_lake

__all__ = ["EXTRA_FORMATS", "HIDDEN", "write_edge_lake"]

#: Formats Pillow decodes that a lake may hold: file name -> Pillow format.
EXTRA_FORMATS = {"icon.ico": "ICO", "scan.jp2": "JPEG2000", "frame.ppm": "PPM", "render.tga": "TGA"}

#: Keys (below the lake) of the hidden objects :func:`write_edge_lake` writes.
HIDDEN = (
    ".DS_Store",
    "cat/.ipynb_checkpoints/img_00000-checkpoint.png",
    "cat/._img_00000.png",
    "__MACOSX/cat/._img_00002.png",
    "dog/Thumbs.db",
    "dog/desktop.ini",
)


def write_edge_lake(tmp: Path) -> Path:
    """Write ``tmp/raw`` and the folders its links point to; return ``tmp/raw``.

    - ``cat2 -> ../more-cats``: a class that is a link (6 images);
    - ``dog/linked -> ../../extra-dogs``: a folder link inside a class (4 images);
    - ``dog/loop -> ..``: a link to an ancestor; ``cat/dangling.png``: a dangling link;
      ``cat/selfloop.png -> selfloop.png``: a link that never resolves;
    - :data:`HIDDEN` and ``cat/notes.tmp`` (for ``--exclude '*.tmp'``);
    - ``dup/copy_{0..7}.png`` (one image, eight keys, in a class of ten: a split of it into two
      halves must put copies in both) and ``fox/copy_of_cat.png`` (= ``cat/img_00001.png``);
    - ``fox/`` also holds :data:`EXTRA_FORMATS`.
    """
    raw = tmp / "raw"
    write_lake(raw, {"cat": 12, "dog": 12, "fox": 8}, nested=False)
    write_lake(tmp / "more-cats", {"x": 6}, seed=5, nested=False)
    (tmp / "more-cats" / "x").rename(tmp / "more-cats-x")
    write_lake(tmp / "extra", {"x": 4}, seed=6, nested=False)
    (tmp / "extra" / "x").rename(tmp / "extra-dogs")
    os.symlink("../more-cats-x", raw / "cat2")
    os.symlink("../../extra-dogs", raw / "dog" / "linked")
    os.symlink("..", raw / "dog" / "loop")
    os.symlink("nowhere.png", raw / "cat" / "dangling.png")
    os.symlink("selfloop.png", raw / "cat" / "selfloop.png")
    for key in HIDDEN:
        (raw / key).parent.mkdir(parents=True, exist_ok=True)
        (raw / key).write_bytes(
            (raw / "cat" / "img_00000.png").read_bytes()
            if key.endswith(".png") and "._" not in key
            else b"\x00\x05\x16\x07 AppleDouble or Windows junk"
        )
    (raw / "cat" / "notes.tmp").write_bytes(b"scratch")
    copy = encode(make_image(999), "PNG")
    (raw / "dup").mkdir()
    for i in range(8):
        (raw / "dup" / f"copy_{i}.png").write_bytes(copy)
    for i in range(2):
        (raw / "dup" / f"img_{i}.png").write_bytes(encode(make_image(2000 + i), "PNG"))
    (raw / "fox" / "copy_of_cat.png").write_bytes((raw / "cat" / "img_00001.png").read_bytes())
    for name, fmt in EXTRA_FORMATS.items():
        (raw / "fox" / name).write_bytes(encode(make_image(3000 + len(name), size=(48, 40)), fmt))
    return raw
