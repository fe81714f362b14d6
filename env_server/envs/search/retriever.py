"""BM25 retrieval over a corpus of passages with tantivy, its index cached on disk.

**Why tantivy, not bm25s.** bm25s 0.3.16 and tantivy 0.27.0 measured on the 2-core dev machine
(shared with a CI run), 1,000 queries, top 5, one query per call as the env issues them:

====================================  ========  =========  ========  ==========  ===========  =========
corpus                                library   build (s)  open (s)  index (MB)  queries/s    recall@5
====================================  ========  =========  ========  ==========  ===========  =========
synthetic, 30,000 passages x 53 words bm25s     1.48       0.011     9.5         765          0.875
synthetic, 30,000 passages x 53 words tantivy   0.96       0.000     4.4         2,904        0.912
default facts, 39,848 x 17 words      bm25s     0.90       0.009     5.3         402          0.901
default facts, 39,848 x 17 words      tantivy   0.41       0.002     2.8         1,280        0.993
====================================  ========  =========  ========  ==========  ===========  =========

(recall@5: the passage a query came from, or a facts question's first evidence passage, is among
the top 5.) tantivy builds 2x faster, answers 3-4x more queries per second, keeps a smaller index
that opens memory-mapped in milliseconds, and ships an English stemmer (bm25s needs PyStemmer for
one and ran without: one reason for its lower recall). Both ran with their default analysis; ours
below takes tantivy to recall@5 1.000 on the default facts' 3,352 single-hop questions. One tantivy
searcher answers concurrent queries from the host's worker threads, so a server process keeps one
index for all its instances.

**Queries.** Agents write free text, but tantivy parses a query language (``field:``, ``+``,
``"``, ``AND``/``OR``), so :func:`query_terms` keeps only the alphanumeric words, lower-cased: a
query of punctuation, control or binary characters has no terms and finds nothing. At most
:data:`MAX_QUERY_TERMS` words are used, which bounds the cost of a 100 KB query.

**Analysis.** Titles and texts are split on non-alphanumerics, lower-cased, folded to ASCII
(``Embarcacion`` finds ``Embarcación``) and stemmed. A title hit weighs :data:`TITLE_BOOST` times
a text hit: questions name their first hop ("the city of Charallave"), and that passage's title.

**Cache.** The index lives in ``<cache_dir>/search/index/tantivy-<version>-<format>-<corpus hash>``:
a changed corpus, tantivy release or analysis (:data:`INDEX_FORMAT`) gets a new folder. It is
built in a temporary folder renamed into place, so concurrent first starts never open half an
index. Without a ``cache_dir`` the index is built in memory (tests, small corpora).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

import tantivy

from env_server.envs.search.corpus import Passage, corpus_hash

# Bump when the schema or the analysis below changes: it renames the cache folder.
INDEX_FORMAT = "1"
ANALYZER = "stargym_en"
FIELDS = ["title", "text"]
# Default facts, recall@5 of all 3,352 single-hop questions: 0.999 with 1.0, 1.000 with 2.0 or 3.0;
# of 1,000 multi-hop questions' first hop: 0.992 with 1.0, 0.999 with 2.0.
TITLE_BOOST = 2.0
# On the default corpus a query of 16 words takes 1.0 ms, of 64 1.7 ms, of 256 2.8 ms, of 1,024
# 5.8 ms; no real search query has more than a few dozen words.
MAX_QUERY_TERMS = 64
WRITER_HEAP_BYTES = 64 * 1024 * 1024
WORD = re.compile(r"[^\W_]+")  # what tantivy's simple tokenizer keeps: runs of letters and digits


def query_terms(query: str) -> list[str]:
    """The words of ``query`` that retrieval uses, all of them (see :data:`MAX_QUERY_TERMS`)."""
    return WORD.findall(query.lower())


class Retriever:
    """Top-k BM25 search over ``passages``; safe to share between threads.

    ``cache_dir``: where the index is kept between processes (see the module docstring); None
    builds it in memory.
    """

    def __init__(self, passages: Sequence[Passage], cache_dir: Path | None = None) -> None:
        if not passages:
            raise ValueError("a retriever needs at least one passage")
        self.passages = list(passages)
        self.key = corpus_hash(self.passages)
        if cache_dir is None:
            self.index = _build(self.passages, None)
        else:
            self.index = _open_or_build(self.passages, cache_dir / "search" / "index" / self.folder_name())
        self._searcher = self.index.searcher()

    def folder_name(self) -> str:
        return f"tantivy-{version('tantivy')}-{INDEX_FORMAT}-{self.key[:32]}"

    def search(self, query: str, k: int) -> list[Passage]:
        """The ``k`` passages that match ``query`` best, best first; none for a query without words."""
        terms = query_terms(query)[:MAX_QUERY_TERMS]
        if not terms or k < 1:
            return []
        parsed = self.index.parse_query(" ".join(terms), FIELDS, field_boosts={"title": TITLE_BOOST})
        hits = self._searcher.search(parsed, k).hits
        return [self.passages[self._searcher.doc(address)["row"][0]] for _, address in hits]


_SHARED: dict[tuple[str, Path | None], Retriever] = {}
_SHARED_LOCK = threading.Lock()


def shared_retriever(passages: Sequence[Passage], cache_dir: Path | None = None) -> Retriever:
    """The process's one retriever of ``passages``: every env instance searches the same index.

    The lock makes concurrent first calls (resets on the host's worker threads) build it once.
    """
    key = (corpus_hash(passages), cache_dir)
    with _SHARED_LOCK:
        retriever = _SHARED.get(key)
        if retriever is None:
            retriever = _SHARED[key] = Retriever(passages, cache_dir)
        return retriever


def _schema() -> tantivy.Schema:
    builder = tantivy.SchemaBuilder()
    builder.add_integer_field("row", stored=True, indexed=False)  # the passage's position in the corpus
    for field in FIELDS:
        builder.add_text_field(field, tokenizer_name=ANALYZER)
    return builder.build()


def _register_analyzer(index: tantivy.Index) -> None:
    """Custom analyzers are not stored in the index: register ours on every index opened."""
    analyzer = (
        tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
        .filter(tantivy.Filter.remove_long(40))
        .filter(tantivy.Filter.lowercase())
        .filter(tantivy.Filter.ascii_fold())
        .filter(tantivy.Filter.stemmer("english"))
        .build()
    )
    index.register_tokenizer(ANALYZER, analyzer)


def _build(passages: list[Passage], path: Path | None) -> tantivy.Index:
    index = tantivy.Index(_schema(), path=None if path is None else str(path))
    _register_analyzer(index)
    # One thread: a server builds this once, and its cores serve requests meanwhile.
    writer = index.writer(heap_size=WRITER_HEAP_BYTES, num_threads=1)
    for row, passage in enumerate(passages):
        writer.add_document(tantivy.Document(row=row, title=passage.title, text=passage.text))
    writer.commit()
    writer.wait_merging_threads()
    index.reload()
    return index


def _open_or_build(passages: list[Passage], folder: Path) -> tantivy.Index:
    if folder.is_dir():
        try:
            index = tantivy.Index.open(str(folder))
        except ValueError:  # files missing (a cut-short copy has no meta.json): tantivy cannot open it
            index = None
        if index is not None:
            _register_analyzer(index)
            if index.searcher().num_docs == len(passages):
                return index
        shutil.rmtree(folder, ignore_errors=True)  # damaged (not ours to trust): build it again
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        _build(passages, staging)
        staging.rename(folder)
    except OSError:
        if not folder.is_dir():  # not a lost race with another process: a real write error
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    index = tantivy.Index.open(str(folder))
    _register_analyzer(index)
    return index
