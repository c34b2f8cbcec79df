"""Search: FTS5 over the Jargon File, safe against query syntax, read-only and thread-safe."""

from __future__ import annotations

import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from app.tools import search
from app.tools.base import ToolError
from app.tools.search import FtsSearch, Hit, JARGON_CORPUS, fts_match_expression, search_tool, term_in


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    """A fresh TEXTENV_CACHE_DIR, so the index is rebuilt by the project's own code."""
    directory = tmp_path_factory.mktemp("textenv-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TEXTENV_CACHE_DIR", str(directory))
        yield directory


@pytest.fixture(scope="module")
def backend(cache: Path):
    fts = FtsSearch()
    search.set_backend(fts)
    yield fts
    search.set_backend(None)
    fts.close()


def test_corpus_is_committed_and_compact() -> None:
    assert JARGON_CORPUS.exists()
    assert JARGON_CORPUS.stat().st_size < 3_000_000
    entries = search.load_corpus()
    assert len(entries) == 2307
    assert all(title and text for title, text in entries)
    assert (JARGON_CORPUS.parent / "SOURCE.md").exists()


def test_index_is_built_in_the_cache_dir_and_opened_read_only(backend: FtsSearch, cache: Path) -> None:
    db = backend.connection()
    path = backend.index_path
    assert path.parent == cache and path.name.startswith("jargon-") and path.suffix == ".db"
    assert path.exists()
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]  # temp file renamed away
    assert db.execute("SELECT count(*) FROM entries").fetchone()[0] == 2307
    with pytest.raises(sqlite3.OperationalError):
        db.execute("INSERT INTO entries(title, text) VALUES ('x', 'y')")
    with pytest.raises(sqlite3.OperationalError):
        db.execute("DELETE FROM entries")


def test_concurrent_first_builds_are_safe(tmp_path: Path) -> None:
    backends = [FtsSearch(index_dir=tmp_path) for _ in range(4)]
    barrier = threading.Barrier(len(backends))

    def first_search(fts: FtsSearch) -> str:
        barrier.wait()
        return fts.search("kludge", 1)[0].title

    with ThreadPoolExecutor(len(backends)) as pool:
        assert list(pool.map(first_search, backends)) == ["kludge"] * len(backends)
    assert [p.name for p in tmp_path.iterdir()] == [backends[0].index_path.name]
    for fts in backends:
        fts.close()


@pytest.mark.parametrize("word", ["hacker", "foobar", "kludge", "TCP/IP", "What is a hacker?"])
def test_known_word_comes_first(backend: FtsSearch, word: str) -> None:
    expected = word.rstrip("?").split()[-1].lower()
    assert backend.search(word, 3)[0].title.lower() == expected


@pytest.mark.parametrize("query, title, opening", [
    ("grok", "grok", "To understand."),  # sense 1, after pronunciation, part of speech, etymology and a usage note
    ("bignum", "bignum", "A multiple-precision computer representation for very large integers"),  # [techspeak]
    ("Heisenbugs", "heisenbug", "A bug that disappears or alters its behavior"),  # case and plural
    ("brain damaged", "brain-damaged", "Obviously wrong; cretinous; demented"),  # spacing; bracket inside a sense
    ("what does yak shaving mean", "yak shaving", "Any seemingly pointless activity"),  # question words dropped
    ("wizard", "wizard", "Transitively, a person who knows how a complex piece of software or hardware works"),
    ("bit rot", "bit rot", "Hypothetical disease"),  # the alias note "Also bit decay." is not a definition
    # Regression: the model asked for "core dump error" and answered from a third entry it was shown
    ("core dump error", "core dump", "A copy of the contents of core"),  # a headword, then words qualifying it
    ("cookie in hacker slang", "cookie", "A handle, transaction ID, or other token of agreement"),
])
def test_a_named_headword_is_the_one_hit_with_a_clean_opening(backend: FtsSearch, query, title, opening) -> None:
    hit = backend.search(query, 3)[0]
    assert hit.exact and hit.title == title and hit.text.startswith(opening), hit
    assert not any(mark in hit.text for mark in "[]/\n") and "…" not in hit.text[:-1]  # cut only at its end
    assert not hit.text.endswith(".")  # (the model copying it then goes on with <submit>, not a new line)
    assert search_tool(query) == f"{title}: {hit.text}"  # one line: nothing for the model to mix it up with


def test_a_pointer_entry_gives_the_definition_it_points_to(backend: FtsSearch) -> None:
    # "kludge": "1. Incorrect (though regrettably common) spelling of kluge (US)."
    assert search_tool("kludge") == ("kludge (see kluge): A Rube Goldberg (or Heath Robinson) device, whether in "
                                     "hardware or software")


def test_without_a_headword_the_best_entries_each_give_their_opening(backend: FtsSearch) -> None:
    hits = backend.search("computer that crashes a lot", 3)
    assert len(hits) == 3 and not any(hit.exact for hit in hits)
    lines = search_tool("computer that crashes a lot").split("\n")
    assert [line.split(": ", 1)[0] for line in lines] == [hit.title for hit in hits]
    assert all(len(line) <= 400 // 3 for line in lines)


def test_an_answer_copies_the_first_entry() -> None:
    from app.tools.search import first_entry

    assert first_entry("grok: To understand.") == "grok: To understand."
    assert first_entry("kludge (see kluge): A device.\nother: x") == "kludge (see kluge): A device."


BREAKERS = ["C++", "what's", '"unbalanced', "AND", "a OR", "(x", "C#", "foo:bar", "-x", "*", "NEAR(",
            "NOT", "x AND", "title:hacker", "^kludge", "hack*", "'; DROP TABLE entries; --", '""', "\\", "é"]


@pytest.mark.parametrize("query", BREAKERS)
def test_fts_syntax_cannot_break_a_query(backend: FtsSearch, query: str) -> None:
    backend.search(query, 3)  # no sqlite3 error
    try:
        text = search_tool(query)
    except ToolError as exc:
        assert "words to search" in str(exc) or "empty" in str(exc)
    else:
        assert text and len(text) <= 400


@pytest.mark.parametrize("query", ["", "   ", "\n"])
def test_empty_query_is_a_clear_error(backend: FtsSearch, query: str) -> None:
    with pytest.raises(ToolError, match="empty query"):
        search_tool(query)
    assert backend.search(query, 3) == []


def test_match_expression_quotes_every_term() -> None:
    assert fts_match_expression('C++ "x" foo:bar') == '"C" OR "x" OR "foo" OR "bar"'
    assert fts_match_expression("what is a kludge") == '"kludge"'
    assert fts_match_expression("AND") == '"AND"'  # quoted: a word, not the operator
    assert fts_match_expression("*+-()") is None


def test_tool_output_is_short(backend: FtsSearch) -> None:
    text = search_tool("hacker")
    assert text.startswith("hacker: A person who enjoys exploring") and "\n" not in text
    assert len(text) <= 220


@pytest.mark.parametrize("query, expected", [
    # Regression (benchmarks/answer_quality.py): "Explain the term sneakernet." searched "skewernet", found
    # nothing, and the model answered with the prompt's fencepost definition
    ("skewernet", 'sneakernet (closest to "skewernet"): Term used (generally with ironic intent) for transfer'),
    ("frobnicat", 'frobnicate (closest to "frobnicat"): To manipulate or adjust, to tweak'),
    ("zzqxjv", 'no results for "zzqxjv"'),  # nothing spelled like it
    ("lose_loss_error", 'no results for "lose_loss_error"'),  # "lose lose" is not close enough (0.67)
])
def test_a_query_that_matches_nothing_gets_the_closest_headword(backend: FtsSearch, query, expected) -> None:
    assert search_tool(query).startswith(expected)


def test_a_near_miss_is_only_a_fallback(backend: FtsSearch) -> None:
    assert search_tool("sneakernet").startswith("sneakernet: Term used")  # the name itself: no "closest"
    assert "closest" not in search_tool("computer that crashes a lot")  # words that match entries: BM25 as before


def test_concurrent_searches(backend: FtsSearch) -> None:
    queries = ["hacker", "foobar", "kludge", "C++", "what's", "cruft", "grok", "wizard"] * 10
    expected = {q: backend.search(q, 3) for q in set(queries)}
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda q: (q, backend.search(q, 3), search_tool(q)), queries))
    for query, hits, text in results:
        assert hits == expected[query]
        assert text.startswith(hits[0].title)


def test_backend_is_swappable() -> None:
    class Fixed:
        def search(self, query: str, limit: int) -> list[Hit]:
            return [Hit("answer", f"you asked {query}")][:limit]

    search.set_backend(Fixed())
    try:
        assert search_tool("anything") == "answer: you asked anything"
    finally:
        search.set_backend(None)


def test_no_headwords_opening_is_only_its_labels() -> None:
    """Regression (review): "//" (an empty pronunciation) and labels without their period or outside the list
    ("n", "adj", "prov.", "obs.", "cav") were not apparatus, so 60 entries, YMMV, AFAIK, 404, BOFH and Murphy's Law
    among them, gave "//, n" or "prov" as their definition, and the model answered "Result = 404: n"."""
    import gzip
    import json
    import re

    from app.tools.jargon import opening

    label = r"(?:n|v|vt|vi|adj|adv|interj|imp|prep|excl|conj|pron|abbrev|suff|pref|prov|quant|cav|obs)"
    labels = re.compile(rf"[/\s,.]*(?:(?:pl\.\s*)?{label}\.?[\s,.]*)*", re.IGNORECASE)
    with gzip.open(JARGON_CORPUS, "rt", encoding="utf-8") as lines:
        bare = [row["title"] for row in map(json.loads, lines) if labels.fullmatch(opening(row["text"]))]
    assert bare == []
    assert search_tool("YMMV").startswith("YMMV: Abbreviation for Your mileage may vary")
    assert search_tool("404").startswith("404: Extended to humans")


@pytest.mark.parametrize("word, definition", [("AFAIK", "As Far As I Know"), ("AFK", "Away From Keyboard"),
                                              ("GPV", "General Public Virus in widespread use"),
                                              ("RTFAQ", "Read the FAQ!, an exhortation")])
def test_an_abbreviation_is_defined_by_what_it_stands_for(word, definition) -> None:
    """Regression (Chromium): "Abbrev." was stripped as a part-of-speech label, so AFAIK's definition read "for
    “As Far As I Know”" (5 entries so). Kept as "Abbrev. for …", the model answered "Result = AFAIK: AFAIK:
    AFAIK:"; the expansion alone it copies ("Result = AFAIK: As Far As I Know"), and AFK's is not lengthened with
    the next sentence as a short first sentence is (the model paraphrased that: "A message that is sent to …")."""
    assert search_tool(word) == f"{word}: {definition}" or search_tool(word).startswith(f"{word}: {definition} ")


@pytest.mark.parametrize("question, term", [
    ("What is a magic cookie?", "magic cookie"), ("What is gumby?", "gumby"), ("Define toaster.", "toaster"),
    ("Explain the term semi.", "semi"), ("Define clocks.", "clocks"), ("What does grok mean?", "grok"),
    ("What is the meaning of kludge?", "kludge"), ("meaning of cruft", "cruft"), ("What are bogons?", "bogons"),
    ("What is 404?", "404"),  # (a headword)
    # regressions (demo questions): "What does TLA stand for?" looped in its query ("t-l-a-l-a-r-a-l-a-r..."),
    # "Explain what a daemon is." searched "what a daemon is"
    ("What does TLA stand for?", "TLA"), ("What do FUD and RTFM stand for?", None), ("Explain what a daemon is.", "daemon"),
    ("Explain what bogons are.", "bogons"), ("What does AFAIK stand for?", "AFAIK"),
    ("What is your name?", None), ("What's up?", None), ("Tell me about yourself.", None),  # greetings
    ("What is love?", None),  # no such headword: the model's (it may still search)
    ("What is 2 + 2?", None), ("What is a cookie in hacker slang?", None),  # more than a term
    ("What is skewernet?", None),  # only spelled like one (sneakernet): the model's
    ("What is up?", None), ("Define me.", None), ("What is life?", None),  # chat words (review: up, /me, Life)
    ("What is a hacker?" + " " * 483 + "and tell me about its history", None),  # longer than a query
])
def test_the_term_a_question_asks_the_meaning_of(question, term):
    assert term_in(question) == term


def test_a_failing_index_leaves_the_question_to_the_model(caplog):
    class Broken:
        def search(self, query: str, limit: int) -> list[Hit]:
            raise RuntimeError("index gone")

    search.set_backend(Broken())
    try:
        with caplog.at_level("ERROR", logger="app.tools.search"):
            assert term_in("What is a hacker?") is None
    finally:
        search.set_backend(None)
    assert any("for a claim failed" in r.message for r in caplog.records)
