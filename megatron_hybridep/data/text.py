"""UTF-8 text as byte tokens in Megatron's indexed-dataset format (PREFIX.bin / PREFIX.idx).

Every byte is one token (0..254: 0xFF never occurs in UTF-8) and each document ends with EOD = 255,
the end-of-document id of Megatron's NullTokenizer at --vocab-size 256 (vocab_size - 1), so the
project's default tokenizer settings read the data as is. Documents are exact slices of the text:
concatenated without their EOD they give the source bytes back.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass

import numpy as np

VOCAB_SIZE = 256
EOD = VOCAB_SIZE - 1  # NullTokenizer's eod at vocab 256; a byte UTF-8 never uses
FORMAT = 1  # bump when the tokens written for the same input change (invalidates prepared copies)
DEFAULT_DOC_BYTES = 16384

# A heading that starts a new document: a short line of its own between blank lines (so prose that
# happens to start a line with "Part of ..." is not one): "CHAPTER I", "Chapter 12", "BOOK II".
_HEADING = re.compile(rb"(?:\A|\n[ \t\r]*\n)([ \t]*(?:CHAPTER|Chapter|BOOK|Book|PART|Part|VOLUME|Volume)[ \t]+"
                      rb"[^\n]{1,60})(?=\r?\n[ \t\r]*\n|\r?\n?\Z)")
_PARAGRAPH = re.compile(rb"\n[ \t\r]*\n(?=[ \t\r]*\S)")  # a blank line before more text


class CorpusError(Exception):
    """A corpus that cannot be read or prepared; the message says how to fix it."""


def read_utf8(path: str) -> bytes:
    """The file's bytes, checked to be UTF-8 text."""
    if not os.path.isfile(path):
        raise CorpusError(f"corpus file {path!r} does not exist; pass --corpus with the path of a UTF-8 text file")
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(
            f"corpus file {path!r} is not UTF-8 (byte {e.start}: {e.reason}); convert it first, e.g. "
            f"'iconv -f latin1 -t utf-8 {path} > {os.path.basename(path)}.utf8'") from None
    if not data.strip():
        raise CorpusError(f"corpus file {path!r} is empty; pass a file with some text in it")
    return data


def split_documents(data: bytes, max_bytes: int = DEFAULT_DOC_BYTES) -> list[bytes]:
    """Cut text into documents: always before a heading line (chapter, book, part, volume), and
    otherwise at a paragraph start once a document holds ``max_bytes``. A paragraph is never cut, so a
    document may exceed ``max_bytes``. b"".join(result) == data."""
    if max_bytes < 1:
        raise ValueError("max_bytes must be positive")
    hard = {m.start(1) for m in _HEADING.finditer(data)} - {0}
    soft = {m.end() for m in _PARAGRAPH.finditer(data)}
    docs, start = [], 0
    for cut in sorted(hard | soft):
        if cut in hard or cut - start >= max_bytes:
            piece = data[start:cut].strip()
            if b"\n" in piece or len(piece) > 64:  # a lone short line ("VOLUME I") joins the next
                docs.append(data[start:cut])
                start = cut
    if data[start:].strip() or not docs:
        docs.append(data[start:])
    else:
        docs[-1] += data[start:]  # trailing whitespace stays with the last document
    return docs


@dataclass(frozen=True)
class Prepared:
    prefix: str
    documents: int
    tokens: int  # including one EOD per document
    text_bytes: int
    file_bytes: int  # .bin + .idx on disk
    source: str
    sha256: str
    max_doc_bytes: int
    format: int = FORMAT


def _manifest_path(prefix: str) -> str:
    return prefix + ".json"


def load_manifest(prefix: str) -> Prepared | None:
    try:
        with open(_manifest_path(prefix)) as f:
            return Prepared(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def prepare(texts: list[bytes], prefix: str, source: str,
            max_doc_bytes: int = DEFAULT_DOC_BYTES) -> tuple[Prepared, bool]:
    """Write ``texts`` (each split into documents) to PREFIX.bin/.idx and PREFIX.json. Returns the
    manifest and whether anything was written: a prefix already prepared from the same bytes and
    settings is left alone. Files appear by rename, so a reader never sees a half-written prefix."""
    digest = hashlib.sha256()
    for t in texts:
        digest.update(len(t).to_bytes(8, "little") + t)
    sha = digest.hexdigest()
    old = load_manifest(prefix)
    if (old is not None and old.sha256 == sha and old.max_doc_bytes == max_doc_bytes and old.format == FORMAT
            and os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
        return old, False

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=DType.optimal_dtype(VOCAB_SIZE))
    documents = tokens = 0
    for text in texts:
        for doc in split_documents(text, max_doc_bytes):
            ids = np.frombuffer(doc, dtype=np.uint8).astype(np.int64)
            ids = np.append(ids, EOD)
            builder.add_document(ids, [len(ids)])
            documents, tokens = documents + 1, tokens + len(ids)
    builder.finalize(tmp + ".idx")
    for ext in (".bin", ".idx"):
        os.replace(tmp + ext, prefix + ext)
    file_bytes = os.path.getsize(prefix + ".bin") + os.path.getsize(prefix + ".idx")
    done = Prepared(prefix, documents, tokens, sum(len(t) for t in texts), file_bytes, source, sha, max_doc_bytes)
    with open(tmp + ".json", "w") as f:
        json.dump(asdict(done), f, indent=1)
    os.replace(tmp + ".json", _manifest_path(prefix))
    return done, True


def read_documents(prefix: str) -> list[bytes]:
    """The documents of an indexed dataset as bytes, EOD stripped (a check of what was written)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    out = []
    for i in range(len(ds)):
        ids = np.asarray(ds[i])
        if len(ids) == 0 or ids[-1] != EOD:
            raise CorpusError(f"{prefix}: document {i} does not end with EOD={EOD}; not a byte corpus")
        out.append(ids[:-1].astype(np.uint8).tobytes())
    return out
