#!/usr/bin/env bash
# Re-create assets/jargon/jargon.jsonl.gz from the Debian dict-jargon package (Jargon File 4.4.7,
# public domain). Only needed to regenerate the committed corpus; the app never runs this.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
apt-get download dict-jargon
dpkg-deb -x dict-jargon_*.deb extracted
python3 "$ROOT/scripts/convert_jargon.py" extracted/usr/share/dictd "$ROOT/assets/jargon/jargon.jsonl.gz"
