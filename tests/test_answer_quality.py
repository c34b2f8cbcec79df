"""A floor under answer quality: the reported test set, both protocols, guided and unguided, on the bundled model in
process.

Runs `benchmarks/answer_quality.py --set test --protocol textenv chat --guide on off --floors` (57 questions and the
Batch questions each way, greedy) and prints its table in the test run's output; it fails where a count is under its floor
(answer_quality.FLOORS, a little below today's counts).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_answer_quality_stays_above_its_floors_on_both_protocols_with_the_guide_on_and_off(capsys):
    command = [sys.executable, "benchmarks/answer_quality.py", "--set", "test", "--protocol", "textenv", "chat",
               "--guide", "on", "off", "--floors"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    table = done.stdout[done.stdout.find("\n| set |"):done.stdout.find("\nanswers that differ")]
    with capsys.disabled():  # the table, in CI's output whatever the outcome
        print(f"\nanswer quality ({' '.join(command[1:])}):{table}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
