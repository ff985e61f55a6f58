"""Real-text corpora (megatron_hybridep/data: text, austen, prepare, windows): byte tokens written in
Megatron's indexed-dataset format and read back with Megatron's own reader."""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import pytest
import torch

from megatron_hybridep.data import austen
from megatron_hybridep.data.prepare import main as prepare_main
from megatron_hybridep.data.prepare import prepare_corpus
from megatron_hybridep.data.text import EOD, CorpusError, read_documents, read_utf8, split_documents
from megatron_hybridep.data.windows import TokenWindows

TEXT = (
    "A BOOK OF TESTS\n\nBy Nobody\n\n\n"
    "VOLUME I\n\n\nCHAPTER I\n\n"
    "Caf\u00e9 society met \u201cearly\u201d, na\u00efvely \u2014 and left late. \U0001f600\n"
    "Part of the fortune was spent at once.\n\n"
    "A second paragraph of the first chapter.\n\n\n"
    "CHAPTER II\n\n"
    "The second chapter, short.\n"
)


def _write(tmp_path, text: str | bytes, name: str = "book.txt") -> str:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(path)


def _quiet(*_: object) -> None:
    pass


def test_prepared_file_reads_back_byte_for_byte_with_megatrons_reader(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    src = _write(tmp_path, TEXT)
    done = prepare_corpus(src, out=str(tmp_path / "out" / "book"), log=_quiet)
    ds = IndexedDataset(done.prefix)
    docs = [np.asarray(ds[i]) for i in range(len(ds))]
    assert len(docs) == done.documents == 3  # title page, chapter I (with VOLUME I), chapter II
    assert all(d[-1] == EOD and EOD not in d[:-1] for d in docs)
    assert b"".join(d[:-1].astype(np.uint8).tobytes() for d in docs) == TEXT.encode()
    assert done.tokens == sum(len(d) for d in docs) == len(TEXT.encode()) + 3
    assert done.text_bytes == len(TEXT.encode())
    assert b"".join(read_documents(done.prefix)) == TEXT.encode()


def test_eod_is_the_end_of_document_id_of_megatrons_null_tokenizer_at_vocab_256():
    from megatron.core.tokenizers import MegatronTokenizer

    tok = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=256)
    assert tok.eod == EOD == 255 and tok.vocab_size == 256


def test_prepare_is_idempotent_and_redoes_a_changed_source(tmp_path):
    src, prefix, lines = _write(tmp_path, TEXT), str(tmp_path / "book"), []
    first = prepare_corpus(src, out=prefix, log=lines.append)
    mtime = os.stat(prefix + ".bin").st_mtime_ns
    again = prepare_corpus(src, out=prefix, log=lines.append)
    assert again == first and os.stat(prefix + ".bin").st_mtime_ns == mtime
    assert lines[0].startswith("wrote ") and lines[1].startswith("up to date:")
    assert f"{first.documents} documents, {first.tokens} tokens" in lines[1]
    _write(tmp_path, TEXT + "\nCHAPTER III\n\nMore.\n")
    changed = prepare_corpus(src, out=prefix, log=lines.append)
    assert lines[2].startswith("wrote ") and changed.documents == first.documents + 1
    assert b"".join(read_documents(prefix)).endswith(b"More.\n")


def test_default_prefix_is_in_the_cache_and_keyed_by_content(tmp_path):
    cache = tmp_path / "cache"
    a = prepare_corpus(_write(tmp_path, TEXT, "a.txt"), cache_dir=str(cache), log=_quiet)
    b = prepare_corpus(_write(tmp_path, TEXT + "x\n\ny\n", "a.txt"), cache_dir=str(cache), log=_quiet)
    assert os.path.dirname(a.prefix) == str(cache) and os.path.basename(a.prefix).startswith("a-")
    assert a.prefix != b.prefix and os.path.isfile(b.prefix + ".idx")


def test_split_cuts_at_chapter_headings_but_not_at_prose_that_starts_like_one():
    docs = split_documents(TEXT.encode(), max_bytes=10_000)
    assert b"".join(docs) == TEXT.encode()
    assert [d.split(b"\n")[0] for d in docs] == [b"A BOOK OF TESTS", b"VOLUME I", b"CHAPTER II"]
    assert b"Part of the fortune" in docs[1]  # a line starting "Part ..." inside a paragraph is no heading


def test_split_cuts_long_text_at_paragraphs_never_inside_one():
    paragraphs = [f"Paragraph {i} " + "word " * 40 for i in range(30)]  # one line each, ~215 bytes
    data = "\n\n".join(paragraphs).encode()
    docs = split_documents(data, max_bytes=1000)
    assert b"".join(docs) == data
    assert len(docs) == 6  # 5 paragraphs (>= 1000 bytes) per document
    assert all(d.startswith(b"Paragraph ") for d in docs)
    assert all(len(d) < 1000 + 220 for d in docs)
    assert split_documents(data, max_bytes=10**6) == [data]


def test_split_keeps_trailing_whitespace_and_never_returns_empty_documents():
    data = b"One,\nand on.\n\nTwo,\nand on.\n\n\n   \n"
    assert split_documents(data, max_bytes=1) == [b"One,\nand on.\n\n", b"Two,\nand on.\n\n\n   \n"]
    # a lone short line (a title, "VOLUME I") is no document of its own: it joins the next
    assert split_documents(b"Title\n\nOne,\nand on.\n\n", max_bytes=1) == [b"Title\n\nOne,\nand on.\n\n"]
    assert split_documents(b"   ") == [b"   "]
    with pytest.raises(ValueError):
        split_documents(b"x", max_bytes=0)


def test_missing_file_names_the_fix(tmp_path):
    with pytest.raises(CorpusError, match=r"does not exist; pass --corpus with the path of a UTF-8 text file"):
        read_utf8(str(tmp_path / "nope.txt"))


def test_non_utf8_file_names_the_byte_and_the_fix(tmp_path):
    path = _write(tmp_path, "na\u00efve caf\u00e9".encode("latin-1"), "latin.txt")
    with pytest.raises(CorpusError, match=r"is not UTF-8 \(byte 2: .*iconv -f latin1 -t utf-8"):
        read_utf8(path)


def test_empty_file_is_refused(tmp_path):
    with pytest.raises(CorpusError, match="empty"):
        read_utf8(_write(tmp_path, "\n \n"))


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    assert prepare_main(["--corpus", str(tmp_path / "missing.txt")]) == 2
    assert "error: corpus file" in capsys.readouterr().err
    src = _write(tmp_path, TEXT)
    assert prepare_main(["--corpus", src, "--out", str(tmp_path / "p" / "book")]) == 0
    out = capsys.readouterr().out
    assert "3 documents" in out and f"--data-path {tmp_path / 'p' / 'book'}" in out


def test_token_windows_are_shifted_deterministic_and_differ_per_stream(tmp_path):
    done = prepare_corpus(_write(tmp_path, TEXT * 20), out=str(tmp_path / "w"), log=_quiet)
    w = TokenWindows(done.prefix, seed=3)
    tokens, labels = w.batch(4, 16, stream=0, step=5)
    assert tokens.shape == labels.shape == (4, 16) and tokens.dtype == labels.dtype == torch.int64
    assert (tokens[:, 1:] == labels[:, :-1]).all()
    again, _ = TokenWindows(done.prefix, seed=3).batch(4, 16, stream=0, step=5)
    other, _ = w.batch(4, 16, stream=1, step=5)
    assert (again == tokens).all() and not (other == tokens).all()
    assert w.vocab_needed() == EOD + 1 and 0 < w.unigram_entropy() < np.log(256)


def test_token_windows_name_the_fix_for_a_missing_prefix(tmp_path):
    with pytest.raises(CorpusError, match="scripts/prepare_corpus"):
        TokenWindows(str(tmp_path / "none"))


def _rdb(novels: list[list[bytes]]) -> bytes:
    """An R lazy-load database as the Debian package ships it: per object, a 4-byte length and a
    zlib stream of an XDR (version 3) serialized character vector."""
    out = b""
    for lines in novels:
        blob = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
        blob += struct.pack(">ii", 16, len(lines))
        for line in lines:
            blob += struct.pack(">ii", 0x00040009, len(line)) + line if line is not None else struct.pack(">ii", 9, -1)
        out += struct.pack(">I", len(blob)) + zlib.compress(blob)
    return out


def test_austen_reader_parses_the_packages_r_data(tmp_path):
    path = tmp_path / "Rdata.rdb"
    path.write_bytes(_rdb([[b"EMMA", b"", "Caf\u00e9".encode()], [b"PERSUASION", None, b"end"]]))
    assert austen.novels(str(path)) == [b"EMMA\n\nCaf\xc3\xa9\n", b"PERSUASION\n\nend\n"]
    path.write_bytes(b"\x00\x00\x00\x10not zlib at all")
    with pytest.raises(CorpusError, match="pass --corpus FILE"):
        austen.novels(str(path))


def test_austen_uses_an_unpacked_copy_and_names_the_fix_without_apt(tmp_path, monkeypatch):
    monkeypatch.setattr(os.path, "isfile", lambda p, _f=os.path.isfile: p != "/" + austen.RDB and _f(p))
    monkeypatch.setattr(austen.shutil, "which", lambda _: None)
    with pytest.raises(CorpusError, match="apt-get is not available here; pass --corpus FILE"):
        austen.locate(str(tmp_path), _quiet)
    unpacked = tmp_path / austen.PACKAGE / austen.RDB
    unpacked.parent.mkdir(parents=True)
    unpacked.write_bytes(_rdb([[b"EMMA"]]))
    assert austen.locate(str(tmp_path), _quiet) == str(unpacked)


def _real_rdb() -> str | None:
    for path in ("/" + austen.RDB, os.path.join(austen.default_cache(), austen.PACKAGE, austen.RDB)):
        if os.path.isfile(path):
            return path
    return None


@pytest.mark.skipif(_real_rdb() is None, reason="r-cran-janeaustenr not fetched here (scripts/prepare_corpus)")
def test_the_real_package_holds_six_novels_of_utf8_prose():
    novels = austen.novels(_real_rdb())
    assert len(novels) == 6 and sum(map(len, novels)) > 3_900_000
    assert any(b"It is a truth universally acknowledged" in n for n in novels)
    for n in novels:
        n.decode("utf-8")
