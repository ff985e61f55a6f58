"""Prepare a text corpus as a byte-token Megatron indexed dataset (PREFIX.bin/.idx).

    scripts/prepare_corpus                      # Jane Austen's novels (Debian r-cran-janeaustenr)
    scripts/prepare_corpus --corpus book.txt    # any UTF-8 text file
    scripts/prepare_corpus --out data/austen    # choose the prefix

Then train on it: pretrain_moe.py --data-path PREFIX --split 100,0,0 (vocab 256, NullTokenizer: the
CPU default), or benchmarks/convergence.py --data-path PREFIX. Running it again with the same input
rewrites nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

from megatron_hybridep.data import austen
from megatron_hybridep.data.text import DEFAULT_DOC_BYTES, CorpusError, Prepared, prepare, read_utf8

BUILTIN = "austen"


def default_prefix(corpus: str | None, cache_dir: str) -> str:
    if corpus is None or _is_builtin(corpus):
        return os.path.join(cache_dir, BUILTIN)
    stem = os.path.splitext(os.path.basename(corpus))[0] or "corpus"
    with open(corpus, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    return os.path.join(cache_dir, f"{stem}-{digest}")  # keyed by content: an edited file is re-prepared


def _is_builtin(corpus: str) -> bool:
    return corpus == BUILTIN and not os.path.exists(corpus)


def prepare_corpus(corpus: str | None = None, out: str | None = None, cache_dir: str | None = None,
                   max_doc_bytes: int = DEFAULT_DOC_BYTES, log=print) -> Prepared:  # noqa: ANN001
    """Prepare ``corpus`` (a UTF-8 file; None or "austen": the built-in novels) at ``out`` (default:
    a prefix in the cache) unless already there, and log what the prefix holds."""
    cache_dir = cache_dir or austen.default_cache()
    if corpus is not None and not _is_builtin(corpus):
        texts, source = [read_utf8(corpus)], os.path.abspath(corpus)
    else:
        rdb = austen.locate(cache_dir, log)
        texts, source = austen.novels(rdb), f"Jane Austen's novels, Debian {austen.PACKAGE} ({rdb})"
        for t in texts:
            t.decode("utf-8")
    prefix = out or default_prefix(corpus, cache_dir)
    done, wrote = prepare(texts, prefix, source, max_doc_bytes)
    verb = "wrote" if wrote else "up to date:"
    log(f"{verb} {prefix}.bin/.idx from {source}: {done.documents} documents, {done.tokens} tokens "
        f"({done.text_bytes} text bytes + one EOD per document), {done.file_bytes} bytes on disk")
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", metavar="FILE", help=f"a UTF-8 text file (default: {BUILTIN}, the built-in novels)")
    p.add_argument("--out", metavar="PREFIX", help="output prefix (default: in the cache dir)")
    p.add_argument("--cache-dir", default=None, help=f"default: {austen.default_cache()}")
    p.add_argument("--max-doc-bytes", type=int, default=DEFAULT_DOC_BYTES,
                   help="cut a document at the next paragraph once it holds this many bytes (also cut at "
                        "chapter headings)")
    a = p.parse_args(argv)
    if a.max_doc_bytes < 1:
        p.error("--max-doc-bytes must be positive")
    try:
        done = prepare_corpus(a.corpus, a.out, a.cache_dir, a.max_doc_bytes)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"train on it with: --data-path {done.prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
