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
MAX_LISTING = 1 << 20  # bytes: a checksum list longer than this is no bundle's (a line is ~70 bytes a file)


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


def verify_owner(folder: Path, run_id: str) -> None:
    """A verified bundle's `report.json` says it is `run_id`'s, made under the folder's name
    (`<protocol>-<label>...`): a bundle copied in from another run, or renamed, is refused."""
    import json

    try:
        report = json.loads((folder / "report.json").read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise CorruptChunkError(f"{folder}/report.json is no report ({type(err).__name__})") from None
    if not isinstance(report, dict):
        raise CorruptChunkError(f"{folder}/report.json is no report (a JSON {type(report).__name__})")
    protocol = report.get("protocol")
    name = f"{protocol.get('name') if isinstance(protocol, dict) else None}-{report.get('label')}"
    if report.get("run_id") != run_id:
        raise CorruptChunkError(f"{folder} is run {report.get('run_id')!r}'s evidence, not this run's ({run_id!r})")
    if not folder.name.startswith(name):
        raise CorruptChunkError(f"{folder} holds the evidence of {name!r}: a bundle renamed or swapped")


def verify_bundle(folder: Path) -> int:
    """Check every file of the bundle against its checksum list; returns the number checked.
    A changed, missing or unlisted file is a `CorruptChunkError` naming it; so is a bundle folder or
    list that is a link, a list beyond `MAX_LISTING` bytes, and a listed name that is not a relative
    path inside the bundle (nothing outside it is ever read)."""
    listing = folder / CHECKSUMS
    if folder.is_symlink():
        raise CorruptChunkError(f"{folder} is a link: an evidence bundle is a folder of the run, not a pointer to one")
    if listing.is_symlink() or not listing.is_file():
        raise CorruptChunkError(f"{folder} has no {CHECKSUMS}: not an evidence bundle, or a damaged one")
    if listing.stat().st_size > MAX_LISTING:
        raise CorruptChunkError(f"{listing} is {listing.stat().st_size} bytes: no bundle's checksum list is that long")
    expected: dict[str, str] = {}
    for number, line in enumerate(listing.read_text(errors="replace").splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise CorruptChunkError(f"{listing}:{number} is not '<sha256>  <path>'")
        rel = Path(name)
        if not name or rel.is_absolute() or ".." in rel.parts or name == CHECKSUMS:
            raise CorruptChunkError(f"{listing}:{number} names {name!r}: a bundle lists relative paths inside it")
        expected[name] = digest
    for name in expected:  # nothing is read through a link out of the bundle
        folders = [folder / d for d in Path(name).parents if d != Path(".")]  # the folders it sits in
        if any(d.is_symlink() for d in folders):
            raise CorruptChunkError(f"{folder / name} is reached through a link: a bundle's files are its own")
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
