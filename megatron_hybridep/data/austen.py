"""Jane Austen's six novels (about 4 MB of English prose), as shipped by Debian's r-cran-janeaustenr.

The package keeps the novels as R data (a lazy-load database of zlib-compressed, XDR-serialized
character vectors, one line per element). Only the .deb is fetched, with `apt-get download`, and
unpacked into a cache: installing it would pull in R, and the text is all we need.
"""

from __future__ import annotations

import glob
import os
import shutil
import struct
import subprocess
import zlib

from megatron_hybridep.data.text import CorpusError

PACKAGE = "r-cran-janeaustenr"
RDB = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
_STRSXP, _CHARSXP = 16, 9


def default_cache() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "megatron-hybridep", "corpora")


def locate(cache_dir: str, log=print) -> str:  # noqa: ANN001 - a print-like callable
    """Path of the package's Rdata.rdb: the installed one, else one unpacked into cache_dir (fetched
    with apt-get download, after an apt-get update if the package lists are stale)."""
    installed = "/" + RDB
    if os.path.isfile(installed):
        return installed
    unpacked = os.path.join(cache_dir, PACKAGE, RDB)
    if os.path.isfile(unpacked):
        return unpacked
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise CorpusError(f"the Austen corpus comes from the Debian package {PACKAGE}, but {tool} is not "
                              f"available here; pass --corpus FILE with any UTF-8 text file instead")
    debs = os.path.join(cache_dir, "debs")
    os.makedirs(debs, exist_ok=True)
    log(f"fetching the Debian package {PACKAGE} (about 1.6 MB) into {debs}")
    if _run(["apt-get", "download", PACKAGE], debs) != 0:
        log("apt-get download failed; running apt-get update and retrying")
        _run(["apt-get", "update"], debs)
        if _run(["apt-get", "download", PACKAGE], debs) != 0:
            raise CorpusError(f"'apt-get download {PACKAGE}' failed (see above); run 'apt-get update' as root and "
                              f"retry, or pass --corpus FILE with any UTF-8 text file")
    deb = sorted(glob.glob(os.path.join(debs, f"{PACKAGE}_*.deb")))[-1]
    tmp = os.path.join(cache_dir, f"{PACKAGE}.tmp{os.getpid()}")
    subprocess.run(["dpkg-deb", "-x", deb, tmp], check=True)
    shutil.rmtree(os.path.join(cache_dir, PACKAGE), ignore_errors=True)
    os.replace(tmp, os.path.join(cache_dir, PACKAGE))
    return unpacked


def _run(cmd: list[str], cwd: str) -> int:
    return subprocess.run(cmd, cwd=cwd).returncode


def novels(rdb_path: str) -> list[bytes]:
    """The novels' texts (UTF-8, one element per line joined by newlines), in the database's order."""
    with open(rdb_path, "rb") as f:
        data = f.read()
    out, offset = [], 0
    while offset < len(data):
        d = zlib.decompressobj()
        try:
            blob = d.decompress(data[offset + 4:])  # each entry: 4-byte length, then a zlib stream
        except zlib.error as e:
            raise CorpusError(f"{rdb_path}: entry at byte {offset} is not zlib-compressed ({e}); "
                              f"an unsupported {PACKAGE} version, pass --corpus FILE instead") from None
        offset = len(data) - len(d.unused_data)
        out.append(b"\n".join(_strings(blob, rdb_path)) + b"\n")
    return out


def _strings(blob: bytes, where: str) -> list[bytes]:
    """An XDR-serialized R character vector without attributes (what the package holds)."""
    if blob[:2] != b"X\n":
        raise CorpusError(f"{where}: not an XDR R serialization")
    (version,) = struct.unpack(">i", blob[2:6])
    pos = 14
    if version == 3:  # followed by the native encoding's name
        (n,) = struct.unpack(">i", blob[pos:pos + 4])
        pos += 4 + n
    flags, count = struct.unpack(">ii", blob[pos:pos + 8])
    if flags != _STRSXP:
        raise CorpusError(f"{where}: expected a plain character vector, found R type flags {flags:#x}")
    pos += 8
    lines = []
    for _ in range(count):
        flags, n = struct.unpack(">ii", blob[pos:pos + 8])
        pos += 8
        if flags & 0xFF != _CHARSXP:
            raise CorpusError(f"{where}: expected a string, found R type flags {flags:#x}")
        lines.append(b"" if n < 0 else blob[pos:pos + n])  # n = -1: NA
        pos += max(n, 0)
    return lines
