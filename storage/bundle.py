"""An evidence bundle: a folder of files and a checksum list of all of them (`CHECKSUMS.sha256`,
`sha256sum` format: `<hex>  <relative path>` a line), so a colleague checks it with `sha256sum -c`
or `stepgrpo inspect RUN --verify`. Written into a `.partial` sibling and renamed into place: a
folder under its final name is complete. A bundle is never replaced; another one gets another name.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from stepgrpo.storage.errors import CorruptChunkError, StorageError
from stepgrpo.storage.publish import partial_path

CHECKSUMS = "CHECKSUMS.sha256"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_bundle(final: Path, files: Mapping[str, bytes]) -> Path:
    """Write `files` (relative path -> bytes) and their checksum list as the bundle `final`."""
    if final.exists():
        raise StorageError(f"{final} exists: an evidence bundle is never replaced")
    tmp = partial_path(final)
    if tmp.exists():
        shutil.rmtree(tmp)  # a crashed attempt's leftovers
    for name, data in files.items():
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or name == CHECKSUMS:
            raise ValueError(f"bundle file name {name!r}: a relative path inside the bundle")
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    lines = [f"{hashlib.sha256(files[n]).hexdigest()}  {Path(n).as_posix()}" for n in sorted(files)]
    (tmp / CHECKSUMS).write_text("\n".join(lines) + "\n")
    os.rename(tmp, final)
    return final


def verify_bundle(folder: Path) -> int:
    """Check every file of the bundle against its checksum list; returns the number checked.
    A changed, missing or unlisted file is a `CorruptChunkError` naming it."""
    listing = folder / CHECKSUMS
    if not listing.is_file():
        raise CorruptChunkError(f"{folder} has no {CHECKSUMS}: not an evidence bundle, or a damaged one")
    expected: dict[str, str] = {}
    for number, line in enumerate(listing.read_text().splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise CorruptChunkError(f"{listing}:{number} is not '<sha256>  <path>'")
        expected[name] = digest
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink()}
    present.discard(CHECKSUMS)
    for name in sorted(present - set(expected)):
        raise CorruptChunkError(f"{folder / name} is not in {CHECKSUMS}: a file added to the bundle after it was made")
    for name, digest in expected.items():
        path = folder / name
        if path.is_symlink() or not path.is_file():
            raise CorruptChunkError(f"{path} is missing from the evidence bundle (listed in {CHECKSUMS})")
        if _digest(path) != digest:
            raise CorruptChunkError(
                f"{path} does not match its checksum in {CHECKSUMS}: it changed after the bundle was made"
            )
    return len(expected)
