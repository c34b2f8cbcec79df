"""Reading Jargon File entries: the opening of a definition as clean text, and "see X" redirects. An entry starts with
pronunciation, part of speech and etymology before its numbered senses; what a small model can copy is the first sense's
first sentence or two without that apparatus."""

from __future__ import annotations

import re

MAX_DEFINITION_CHARS = 160  # about 35 tokens: short enough for a small model to copy whole
_SHORT_SENTENCE = 20  # a first sentence shorter than this gets the next one too

# One piece of the apparatus before a definition: a pronunciation, a part of speech (with or without its
# period), a bracketed note, a sense number, or separating punctuation.
_PART_OF_SPEECH = (r"(?:pl\.\s*)?(?:n|v|vt|vi|adj|adv|interj|imp|prep|excl|conj|pron|abbrev|suff|pref|prov|quant|cav"
                   r"|obs)(?:\.|(?=,|\s*\Z))(?!\s*for\b)")
_APPARATUS = re.compile(
    rf"\A(?:\s+|[,;:]|/[^/\n]{{0,40}}/|{_PART_OF_SPEECH}|\[[^\]]*\]|\(also [^)]*\)|\d{{1,2}}\.(?=\s))", re.IGNORECASE)
_BRACKETS = re.compile(r"\s*\[[^\]]*\]")
# "Abbrev. for “As Far As I Know”": the expansion, unquoted, is the meaning the model copies.
_ABBREV_FOR = re.compile(r"\AAbbrev\.\s+for\s+(?:[“‘]([^”’]*)[”’])?")
_FIRST_SENSE = re.compile(r"^1\.\s", re.MULTILINE)
_NOT_DEFINITIONS = ("“", "‘", "Also ")  # usage examples and alias notes ("Also bit decay.")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z“‘(])")
# "Incorrect ... spelling of kluge", "See foo", "Syn. segment", "Same as X", "= X", "Variant of X".
_REDIRECT = re.compile(r"\A(?:.{0,60}\bspelling of|See|Syn\.?|Same as|=|Variant of|Var\. of)\s+(?:the\s+)?"
                       r"([\w][\w\s\-/.']{0,40}?)\s*(?:\(|[.,;]|\Z)", re.IGNORECASE)


def strip_apparatus(text: str) -> str:
    """Text with the leading pronunciations, parts of speech, bracketed notes and sense number removed."""
    while True:
        match = _APPARATUS.match(text)
        if not match or not match.group(0):
            return text
        text = text[match.end():]


def first_sense(text: str) -> str:
    """The paragraph of sense 1 when the entry numbers its senses, else its first paragraph, apparatus removed."""
    numbered = _FIRST_SENSE.search(text)
    body = text[numbered.start():] if numbered else text
    for paragraph in body.split("\n"):
        cleaned = strip_apparatus(paragraph)
        if cleaned.strip():
            return cleaned.strip()
    return ""


def shorten(text: str, limit: int) -> str:
    """At most `limit` characters: cut at the end of a clause ("; ", else ", ") when one ends in the second half,
    else at a word boundary with an ellipsis."""
    if len(text) <= limit:
        return text
    for separator in ("; ", ", "):
        clause = text.rfind(separator, 0, limit)
        if clause > limit // 2:
            return text[:clause]
    cut = text[: limit - 1]
    if " " in cut:
        cut = cut[: cut.rfind(" ")]
    return cut.rstrip(" ,;:") + "…"


def opening(text: str, limit: int = MAX_DEFINITION_CHARS) -> str:
    """The first sentence (two when the first is very short) of sense 1, brackets removed, at most `limit` chars,
    without its final period (so a model copying it ends with `<submit>`). Quoted usage examples and alias notes are
    skipped."""
    sense = " ".join(_BRACKETS.sub("", first_sense(text)).split())
    expanded = _ABBREV_FOR.match(sense)  # (an abbreviation's expansion says it all, however short)
    if expanded:
        sense = (expanded[1] or "") + sense[expanded.end():]
    sentences = [s for s in _SENTENCE_END.split(sense) if s and not s.startswith(_NOT_DEFINITIONS)]
    chosen = sentences[0] if sentences else sense
    if (not expanded and len(chosen) < _SHORT_SENTENCE and len(sentences) > 1
            and len(chosen) + 1 + len(sentences[1]) <= limit):
        chosen += " " + sentences[1]  # "To understand." says little alone
    return shorten(chosen, limit).removesuffix(".")


def redirect_target(text: str) -> str | None:
    """The headword an entry sends the reader to when its first sense is only a pointer ("Incorrect spelling
    of kluge", "Syn. segment"), else None."""
    match = _REDIRECT.match(first_sense(text))
    return match[1].strip() if match else None
