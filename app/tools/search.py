"""Search tool: the Jargon File in an SQLite FTS5 index, behind a swappable interface (`SearchBackend`).

A query naming a headword (any case, a plural, or a redirect such as kludge -> kluge) gets that entry as `title:
opening`; else the best BM25 entries, one line each; else the headword spelled most like the query. The index is built
once from `assets/jargon/jargon.jsonl.gz` into the cache folder under a hash of corpus and layout, written to a
temporary file and renamed, so concurrent first starts are safe; it is opened read-only and shared by all threads. User
text never reaches FTS5 syntax: the query is reduced to `\\w+` terms, each quoted and bound as a parameter.
"""

from __future__ import annotations

import dataclasses
import difflib
import gzip
import hashlib
import json
import logging
import os
import re
import sqlite3
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from app.paths import ASSETS, cache_dir
from app.tools.base import ToolError
from app.tools.jargon import opening, redirect_target, shorten

log = logging.getLogger(__name__)

JARGON_CORPUS = ASSETS / "jargon" / "jargon.jsonl.gz"
INDEX_LAYOUT = "fts5-v1"  # change when the table layout or tokenizer changes
TOKENIZER = "porter unicode61 remove_diacritics 2"
TOOL_RESULTS = 3
CLOSEST = 0.7  # difflib ratio for "did you mean": skewernet -> sneakernet 0.74; lose_loss_error -> lose lose 0.67
MAX_OUTPUT_CHARS = 400
MAX_TERMS = 32
MAX_QUERY_CHARS = 500
# A guided look-up's query is at most this long: longer than nearly every headword, and shorter than a loop the
# repetition stop catches, so a query the model repeats ends as a call that runs
GUIDED_QUERY_CHARS = 32
NO_RESULTS = "no results for"  # the output where nothing matched: `no results for "query"`
_NUMBER_ALONE = re.compile(r"[-+]?[\d.,]+")  # a look-up even where the Calculator reads it: "404"


@dataclass(frozen=True)
class Hit:
    title: str
    text: str  # the opening of the entry's definition
    exact: bool = False  # the query named this headword: the one hit worth showing
    see: str | None = None  # the entry the headword points to, whose definition `text` is
    near: str | None = None  # the query this headword is spelled like, when nothing matched it (did you mean)


class SearchBackend(Protocol):
    def search(self, query: str, limit: int) -> list[Hit]:
        """Best hits first; an empty list when nothing matches or the query has no words."""
        ...


# Question words dropped from a query when other words remain ("what is a kludge" -> "kludge").
STOPWORDS = frozenset(
    "a an the is are was were be what what's whats who whom which does do did mean means meaning meant "
    "define definition of in on to for by with about and or it its s term word jargon slang hacker's "
    "please tell me explain".split()
)


def query_terms(query: str) -> list[str]:
    """The words of a query (`\\w+`), deduplicated case-insensitively, question words dropped
    when other words remain, at most MAX_TERMS."""
    seen: dict[str, str] = {}
    for term in re.findall(r"\w+", query[:MAX_QUERY_CHARS]):
        seen.setdefault(term.lower(), term)
    terms = list(seen.values())
    content = [term for term in terms if term.lower() not in STOPWORDS]
    return (content or terms)[:MAX_TERMS]


def _key(text: str) -> str:
    """A headword's comparable form: lowercase words, hyphens and punctuation as spaces."""
    return " ".join(re.findall(r"\w+", text.lower()))


def headword_keys(query: str) -> list[str]:
    """The headwords a query may name, most literal first: its words, its words without question words,
    those run together ("foo bar" -> "foobar"), and their singulars."""
    words = _key(query[:MAX_QUERY_CHARS]).split()
    content = [w for w in words if w not in STOPWORDS] or words
    keys: list[str] = []
    for phrase in (words, content):
        if not phrase or len(phrase) > 6:
            continue
        for key in (" ".join(phrase), "".join(phrase)):
            keys += [key] + [key[: -len(end)] + add for end, add in (("ies", "y"), ("es", ""), ("s", ""))
                             if key.endswith(end) and len(key) > len(end) + 1]
    return list(dict.fromkeys(keys))


def leading_keys(query: str) -> list[str]:
    """The phrases a longer query opens with, longest first ("core dump error" -> "core dump", "core"), for a
    headword followed by words that qualify it ("cookie in hacker slang")."""
    words = _key(query[:MAX_QUERY_CHARS]).split()
    content = [w for w in words if w not in STOPWORDS]
    return [" ".join(content[:n]) for n in range(min(len(content), 7) - 1, 0, -1)]


def fts_match_expression(query: str) -> str | None:
    """A safe FTS5 MATCH expression (`"a" OR "b"`) for the query, or None when it has no words."""
    terms = query_terms(query)
    if not terms:
        return None
    return " OR ".join('"' + term.replace('"', '""') + '"' for term in terms)


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256(INDEX_LAYOUT.encode())
    digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def load_corpus(path: Path = JARGON_CORPUS) -> list[tuple[str, str]]:
    """(title, text) pairs from a gzip JSON-lines corpus."""
    entries = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                item = json.loads(line)
                entries.append((item["title"], item["text"]))
    return entries


def _fill(db: sqlite3.Connection, corpus: Path) -> None:
    db.execute(f"CREATE VIRTUAL TABLE entries USING fts5(title, text, tokenize='{TOKENIZER}')")
    db.executemany("INSERT INTO entries(title, text) VALUES (?, ?)", load_corpus(corpus))
    db.execute("INSERT INTO entries(entries) VALUES ('optimize')")
    db.commit()


def _memory_index(corpus: Path) -> sqlite3.Connection:
    db = sqlite3.connect(":memory:", check_same_thread=False)
    _fill(db, corpus)
    return db


def build_index(corpus: Path, target: Path) -> Path:
    """Write the FTS5 index for `corpus` to `target` atomically (temp file, then rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        db = sqlite3.connect(tmp)
        try:
            _fill(db, corpus)
        finally:
            db.close()
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + "-journal")):
            leftover.unlink(missing_ok=True)
    return target


class FtsSearch:
    """SQLite FTS5 over a (title, text) corpus; BM25 with the title weighted 10x."""

    def __init__(self, corpus: Path = JARGON_CORPUS, index_dir: Path | None = None):
        self.corpus = Path(corpus)
        self._index_dir = index_dir
        self._db: sqlite3.Connection | None = None
        self._entries: dict[str, tuple[str, str]] | None = None
        self._lock = threading.Lock()

    @property
    def index_path(self) -> Path:
        directory = self._index_dir if self._index_dir is not None else cache_dir()
        return Path(directory) / f"jargon-{_file_hash(self.corpus)}.db"

    def connection(self) -> sqlite3.Connection:
        """The shared read-only connection, building the index on first use."""
        with self._lock:
            return self._connection()

    def _connection(self) -> sqlite3.Connection:
        # called with self._lock held
        if self._db is None:
            try:
                path = self.index_path
                if not path.exists():
                    build_index(self.corpus, path)
                self._db = sqlite3.connect(
                    f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True, check_same_thread=False
                )
            except (OSError, sqlite3.Error):
                # e.g. a read-only home: keep a private in-memory index for this process
                log.warning("cannot use an index file in %s; building it in memory", self._index_dir or "cache_dir()",
                            exc_info=True)
                self._db = _memory_index(self.corpus)
        return self._db

    def search(self, query: str, limit: int = TOOL_RESULTS) -> list[Hit]:
        exact = self.lookup(query)
        match = fts_match_expression(query)
        if match is None:
            return []
        limit = max(1, min(int(limit), 50))
        with self._lock:  # one shared read-only connection; queries take milliseconds
            rows = self._connection().execute(
                "SELECT title, text FROM entries WHERE entries MATCH ? ORDER BY bm25(entries, 10.0, 1.0) LIMIT ?",
                (match, limit + 1),
            ).fetchall()
        hits = [exact] if exact else []
        hits += [Hit(title, opening(text)) for title, text in rows if not exact or title != exact.title]
        if not hits:  # no entry by name or by word: a misspelt headword ("skewernet") gets the closest one
            near = self.closest(query)
            hits = [near] if near else []
        return hits[:limit]

    def lookup(self, query: str) -> Hit | None:
        """The entry the query names (any case or spacing, a plural, or a pointer like kludge -> kluge), or else
        the headword its words open with."""
        headwords = self._headwords()
        for key in headword_keys(query) + leading_keys(query):
            if key in headwords:
                return self._entry(key)
        return None

    def closest(self, query: str) -> Hit | None:
        """The headword spelled most like the query (difflib's ratio at least CLOSEST), as a search engine's
        "did you mean": a small model often misspells a rare word it copies ("sneakernet" as "skewernet")."""
        key = _key(" ".join(query_terms(query)))
        names = difflib.get_close_matches(key, self._headwords(), n=1, cutoff=CLOSEST) if key else []
        return dataclasses.replace(self._entry(names[0]), near=shorten(key, 40)) if names else None

    def _entry(self, key: str) -> Hit:
        """The hit for a headword, with the definition of the entry it points to, if it is only a pointer."""
        headwords = self._headwords()
        title, text = headwords[key]
        target = redirect_target(text)
        pointed = headwords.get(_key(target)) if target else None
        if pointed is not None and pointed[0] != title:
            return Hit(title, opening(pointed[1]), exact=True, see=pointed[0])
        return Hit(title, opening(text), exact=True)

    def _headwords(self) -> dict[str, tuple[str, str]]:
        """Every entry by its normalized headword (2,307 entries, read once)."""
        with self._lock:
            if self._entries is None:
                entries: dict[str, tuple[str, str]] = {}
                for title, text in self._connection().execute("SELECT title, text FROM entries"):
                    entries.setdefault(_key(title), (title, text))
                self._entries = entries
            return self._entries

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


_backend: SearchBackend | None = None
_backend_lock = threading.Lock()


def get_backend() -> SearchBackend:
    """The shared search backend, created on first use."""
    global _backend
    with _backend_lock:
        if _backend is None:
            _backend = FtsSearch()
        return _backend


def set_backend(backend: SearchBackend | None) -> None:
    """Swap the backend (another implementation, or a test double); None resets to the default."""
    global _backend
    with _backend_lock:
        _backend = backend


def format_hit(hit: Hit, max_chars: int) -> str:
    """`title: definition`, `title (see other): definition` for a pointer, `title (closest to "query"): ...`
    for a near miss, within max_chars."""
    title = shorten(hit.title, 40) + (f" (see {shorten(hit.see, 40)})" if hit.see else "")
    title += f' (closest to "{hit.near}")' if hit.near else ""
    return f"{title}: {shorten(hit.text, max(10, max_chars - len(title) - 2))}"


def format_hits(hits: list[Hit], max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """One line per hit, only the first when it is the headword asked for, within max_chars in all."""
    if not hits:
        return ""
    if hits[0].exact:
        hits = hits[:1]
    budget = max_chars // len(hits) - 1  # minus the newline
    return "\n".join(format_hit(hit, budget) for hit in hits)


def first_entry(output: str) -> str:
    """What an answer copies from the output: its first line (a small model copies a whole line best), or nothing."""
    return "" if output.startswith(NO_RESULTS) else output.split("\n", 1)[0]


def is_arithmetic(query: str) -> bool:
    """Whether a query is a sum for the Calculator: text with a digit that the Calculator reads ("2 + 2", "1/0",
    "square root of 2", "15 times 4"); never a number alone (the Jargon File's 0, 2 and 404 are headwords)."""
    from app.tools.calculator import reads

    text = query.strip()
    return any(char.isdigit() for char in text) and not _NUMBER_ALONE.fullmatch(text) and reads(text)


# A question that asks what one term means and nothing else ("Define toaster.", "What does grok mean?"); "what's"
# is left out: "What's up?" is a greeting
_ASKS_A_TERM = re.compile(
    r"\s*(?:define|explain(?: the (?:term|word)| what)?|what (?:is|are)(?: the meaning of)?|(?:the )?meaning of"
    r"|what does|what do)\s+(?:(?:an?|the)\s+)?(?P<term>[\w][\w' -]{0,39}?)(?:\s+(?:mean|stands? for|is|are))?"
    r"\s*[.?!]*\s*", re.IGNORECASE)


# Words a chat asks about that are also headwords ("What is up?", "What is life?"): never claimed
_CHAT_TERMS = frozenset({"up", "life", "me", "you", "it", "this", "that", "love"})


def term_in(question: str) -> str | None:
    """The Jargon File headword a question asks the meaning of, as it writes it, else None; left alone the small model
    often answers such questions without a look-up."""
    asked = _ASKS_A_TERM.fullmatch(question) if len(question) <= MAX_QUERY_CHARS else None
    if asked is None or is_arithmetic(asked["term"]) or _key(asked["term"]) in _CHAT_TERMS:
        return None
    term = asked["term"].strip()
    try:
        hits = get_backend().search(term, 1)
    except Exception:  # a claim is a shortcut: without it the model chooses, and the tool reports the failure
        log.exception("looking up %r for a claim failed", term)
        return None
    return term if hits and names_headword(term, hits[0]) else None


def names_headword(term: str, hit: Hit) -> bool:
    """Whether `term` names the hit's headword itself (any case, a plural; not a near miss, and "me" is not /me)."""
    return hit.exact and hit.near is None and hit.title[:1].isalnum() and _key(hit.title) in headword_keys(term)


def search_tool(query: str) -> str:
    """The Search tool: top hits in the Jargon File as compact text."""
    if not isinstance(query, str) or not query.strip():
        raise ToolError("empty query: give a word or phrase to look up")
    shown = shorten(" ".join(query.split()), 60)
    if is_arithmetic(query):  # as the calculator does with words: the message names the tool for it
        raise ToolError(f'"{shown}" is arithmetic, not a word', hint=("Calculator", "to calculate it, use Calculator"))
    if not query_terms(query):
        raise ToolError(f'no words to search for in "{shown}"')
    hits = get_backend().search(query, TOOL_RESULTS)
    if not hits:
        return f'{NO_RESULTS} "{shown}"'
    return format_hits(hits)
