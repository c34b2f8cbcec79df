#!/usr/bin/env python3
"""Convert the Debian ``dict-jargon`` dictd data into ``assets/jargon/jargon.jsonl.gz``.

Usage: python scripts/convert_jargon.py DICTD_DIR [OUT]
where DICTD_DIR holds ``jargon.index`` and ``jargon.dict.dz`` (see scripts/fetch_corpus.sh).

dictd format: each index line is ``headword<TAB>offset<TAB>length`` with offset and length
in dictd's base64 digits; the ``.dict.dz`` file is gzip (dictzip) data, read here as plain gzip.
Each output line is a JSON object ``{"title": ..., "text": ...}``. The gzip header carries no
timestamp or file name, so the output is byte-for-byte reproducible.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def b64_number(digits: str) -> int:
    n = 0
    for ch in digits:
        n = n * 64 + B64.index(ch)
    return n


def clean_entry(raw: str) -> tuple[str, str]:
    """Return (title, text): title from the entry's first line, text as paragraphs."""
    lines = raw.strip("\n").split("\n")
    title = lines[0].strip()
    paragraphs: list[str] = []
    current: list[str] = []
    for line in lines[1:]:
        stripped = line.strip()
        if not stripped:
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        current.append(stripped)
    if current:
        paragraphs.append(" ".join(current))
    # The first paragraph is the pronunciation/part-of-speech line; "//" means none given.
    if paragraphs and paragraphs[0] == "//":
        paragraphs.pop(0)
    text = "\n".join(paragraphs)
    # {cross reference} braces are markup; keep the words.
    text = text.replace("{", "").replace("}", "")
    text = re.sub(r"[ \t]+", " ", text).strip()
    return title, text


def convert(dictd_dir: Path) -> list[dict[str, str]]:
    data = gzip.decompress((dictd_dir / "jargon.dict.dz").read_bytes())
    entries: list[dict[str, str]] = []
    for line in (dictd_dir / "jargon.index").read_text(encoding="utf-8").splitlines():
        headword, offset, length = line.split("\t")
        if headword.startswith("00-database-") or headword.startswith("00database"):
            continue  # dictd metadata, not entries
        start = b64_number(offset)
        raw = data[start : start + b64_number(length)].decode("utf-8")
        title, text = clean_entry(raw)
        if title and text:
            entries.append({"title": title, "text": text})
    return entries


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    dictd_dir = Path(argv[1])
    out = Path(argv[2]) if len(argv) > 2 else Path(__file__).resolve().parent.parent / "assets/jargon/jargon.jsonl.gz"
    entries = convert(dictd_dir)
    payload = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode("utf-8")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as fh, gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0, compresslevel=9) as gz:
        gz.write(payload)
    print(f"wrote {len(entries)} entries, {out.stat().st_size} bytes -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
