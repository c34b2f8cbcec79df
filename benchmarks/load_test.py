"""Load test of the whole app on loopback: many API clients at once, each its own chat. Bounded; stops by itself.

    python3 benchmarks/load_test.py                        # 20 sessions x 3 turns, default and small KV budget
    python3 benchmarks/load_test.py --sessions 4 --turns 2 --budgets default --json   # the test suite's version

Per budget: starts `app.py` on a free local port (KV_BUDGET_MB set), runs one turn to warm it up, then one client
alone (the solo baseline), then every session at once through gradio_client's `/chat`, each asking arithmetic with
numbers of its own. Reports errors, answers holding their own result, answers holding another session's numbers,
p50/p95 time to first text and per turn, tracebacks in the server's log, and the KV store's peak (polled from
`/stats`) against its budget. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.local_app import running_app  # noqa: E402

SETTINGS = {"max_new_tokens": 48, "max_turns": 2}
STARTUP_S, RUN_S = 240, 1500
POLL_S = 0.02  # how often a client looks for new output: the resolution of its time to first text


def question(session: int, turn: int) -> tuple[str, int, tuple[int, int]]:
    """A question whose operands and result no other session's question shares."""
    a, b = 101 + 13 * session + turn, 7 + session
    return f"What is {a} * {b}?", a * b, (a, b)


def client(url: str):
    """A gradio_client Client, light on the cores it shares with the server: plain HTTP on loopback needs no
    certificates (with verification on, every request built an SSL context: ~18 % of this process's samples
    under load), and nothing is reported anywhere."""
    from gradio_client import Client

    return Client(url, verbose=False, ssl_verify=False, analytics_enabled=False)


def outputs_of(job) -> Iterator[list]:
    """A job's outputs so far, every POLL_S until it is done. Iterating the job instead polls every 1 ms in each
    client thread (gradio_client's Job.__next__): with 20 sessions, most of a core of the two the server runs on."""
    while True:
        done = job.done()
        yield job.outputs()
        if done:
            return
        time.sleep(POLL_S)


def run_session(url: str, session: int, turns: int, deadline: float) -> list[dict]:
    chat, rows = client(url), []
    for turn in range(turns):
        text, expected, _ = question(session, turn)
        sent, first, answer, error = time.perf_counter(), None, "", None
        try:
            job = chat.submit(text, SETTINGS, api_name="/chat")
            for outputs in outputs_of(job):
                if first is None and any(outputs):
                    first = time.perf_counter()
                answer = outputs[-1] if outputs else answer
                if time.perf_counter() > deadline:
                    job.cancel()
                    raise TimeoutError("the run's time limit passed")
            job.result()  # raises the server's error, if the turn failed
        except Exception as exc:  # the client's view: any failure counts as an error
            error = f"{type(exc).__name__}: {exc}"
        done = time.perf_counter()
        rows.append(dict(session=session, turn=turn, answer=answer.split("<response>")[-1], expected=expected,
                         ttft=(first or done) - sent, seconds=done - sent, error=error))
    return rows


def poll_stats(url: str, stop: threading.Event, peak: dict) -> None:
    stats_client = client(url)
    while not stop.wait(0.25):
        try:
            stats = stats_client.predict(api_name="/stats")
        except Exception:  # a missed sample is not a result
            continue
        total = stats["kv_mb"] + stats["shared_kv_mb"]
        if total > peak.get("kv_mb", -1):
            peak.update(kv_mb=total, shared_mb=stats["shared_kv_mb"], budget_mb=stats["budget_mb"])
        peak["scheduler"] = stats.get("scheduler")


def numbers_of(session: int, turns: int) -> set[str]:
    found = set()
    for turn in range(turns):
        _, expected, (a, b) = question(session, turn)
        found |= {str(expected), str(a)}
    return found


def score(rows: list[dict], sessions: int, turns: int) -> dict:
    own = others = 0
    for row in rows:
        digits = set(re.findall(r"\d+", row["answer"].replace(",", "")))
        own += str(row["expected"]) in digits
        theirs = set().union(*(numbers_of(s, turns) for s in range(sessions) if s != row["session"]))
        others += bool(digits & theirs)
    return dict(answered=len(rows), errors=sum(1 for r in rows if r["error"]), own=own, leaks=others)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def phase(budget_mb: str | None, sessions: int, turns: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "app.log"
        with running_app(log, {"KV_BUDGET_MB": budget_mb} if budget_mb is not None else None, STARTUP_S) as url:
            deadline = time.perf_counter() + RUN_S
            # A new server's first turn is not the baseline: its first text took 0.47 s, later ones 0.06 s (before
            # Service.warm_up ran a turn), and with a solo p95 over 3 turns that one was the solo p95.
            warm_up = run_session(url, sessions + 2, 1, deadline)
            solo = run_session(url, sessions + 1, turns, deadline)  # numbers no load session uses
            stop, peak = threading.Event(), {}
            poller = threading.Thread(target=poll_stats, args=(url, stop, peak), daemon=True)
            poller.start()
            began = time.perf_counter()
            with ThreadPoolExecutor(max_workers=sessions) as pool:
                rows = [r for rs in pool.map(lambda s: run_session(url, s, turns, deadline), range(sessions))
                        for r in rs]
            seconds = time.perf_counter() - began
            stop.set()
            poller.join(timeout=5)
        text = log.read_text(errors="replace")
    solo_seconds = sum(r["seconds"] for r in solo)
    return dict(budget_mb=peak.get("budget_mb", budget_mb), sessions=sessions, turns=turns,
                **score(rows, sessions, turns), solo_errors=sum(1 for r in warm_up + solo if r["error"]),
                solo_ttft=statistics_of([r["ttft"] for r in solo]), solo_turn=statistics_of([r["seconds"] for r in solo]),
                ttft=statistics_of([r["ttft"] for r in rows]), turn=statistics_of([r["seconds"] for r in rows]),
                turns_per_s=len(rows) / seconds, solo_turns_per_s=len(solo) / solo_seconds,
                tracebacks=text.count("Traceback"), kv_peak_mb=peak.get("kv_mb"), shared_mb=peak.get("shared_mb"),
                scheduler=peak.get("scheduler"),
                error_samples=[r["error"] for r in rows if r["error"]][:3],
                wrong_samples=[(question(r["session"], r["turn"])[0], r["answer"]) for r in rows
                               if not r["error"] and str(r["expected"]) not in r["answer"].replace(",", "")][:3])


def statistics_of(values: list[float]) -> dict:
    return {"p50": round(pct(values, 0.5), 2), "p95": round(pct(values, 0.95), 2)}


def megabytes(value: float | None) -> str:
    """A polled peak as the table shows it (sums of floats: 61.879999999999995 read as 61.88)."""
    return "not polled" if value is None else f"{value:.2f}"


def report(results: list[dict]) -> None:
    print("| KV budget, MB | sessions × turns | errors | own result | another's numbers | p50 / p95 first text, s "
          "| p95 vs solo | p50 / p95 turn, s | turns/s vs solo | tracebacks | KV peak, MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['budget_mb']} | {r['sessions']} × {r['turns']} | {r['errors']} | {r['own']}/{r['answered']} "
              f"| {r['leaks']} | {r['ttft']['p50']} / {r['ttft']['p95']} (solo {r['solo_ttft']['p95']}) "
              f"| {r['ttft']['p95'] / max(r['solo_ttft']['p95'], 1e-9):.1f}× "
              f"| {r['turn']['p50']} / {r['turn']['p95']} (solo {r['solo_turn']['p95']}) "
              f"| {r['turns_per_s'] / r['solo_turns_per_s']:.2f}× | {r['tracebacks']} | {megabytes(r['kv_peak_mb'])} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--budgets", nargs="+", default=["default", "64"],
                        help="KV_BUDGET_MB per phase ('default': the app's own)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON lines instead")
    args = parser.parse_args()
    if not 1 <= args.sessions <= 64 or not 1 <= args.turns <= 10:
        parser.error("--sessions must be 1..64 and --turns 1..10")
    results = [phase(None if b == "default" else b, args.sessions, args.turns) for b in args.budgets]
    if args.json:
        for r in results:
            print(json.dumps(r))
    else:
        report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
