#!/usr/bin/env python3
"""Agents of the earnings-analysis example, run by Flotilla's `exec` agent.

Each invocation receives the task envelope as JSON on stdin and prints its answer on stdout
(plain text, or a JSON object with "response" and optional "numeric_value" / "tools_used").
A non-zero exit fails the task. Standard library only; deterministic (no model).

The steps collaborate through the run's workspace rather than through each other's results:

    earnings.py fetch CSV  -> writes one entry per quarter to topic "quarterly figures"
                              (`flotilla ws write`)
    earnings.py growth     -> quarter-over-quarter revenue growth, from the quarters in the
    earnings.py margin     -> latest net margin,                    workspace (consumed entries
                              + `flotilla ws watch` for the rest); both start on the topic's
                              first entry, side by side
    earnings.py report     -> the report, from the "growth" and "margin" topics (the entries
                              Flotilla writes from calc_growth's and calc_margin's results)

The worker runs each step with its scope in the environment, so the `flotilla` commands need
no flags; FLOTILLA_BIN names the binary.
"""
import csv
import json
import os
import subprocess
import sys

FLOTILLA = os.environ.get("FLOTILLA_BIN", "flotilla")
FIGURES = "quarterly figures"
# How long an analyst waits for the rest of the quarters once the first has arrived.
WATCH_TIMEOUT_SECS = 120


def flotilla(*args):
    """Runs `flotilla ARGS` and returns its JSON answer; its errors go to our stderr."""
    out = subprocess.run([FLOTILLA, *args], check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout)


def topic_key(topic):
    """Topics are normalised: trimmed, lower case, spaces to underscores."""
    return topic.strip().lower().replace(" ", "_")


def fetch(envelope, path):
    with open(path, newline="") as f:
        rows = [
            {"quarter": r["quarter"], "revenue": float(r["revenue"]), "net_income": float(r["net_income"])}
            for r in csv.DictReader(f)
        ]
    if len(rows) < 2:
        sys.exit(f"{path}: need at least two quarters, found {len(rows)}")
    # One entry per quarter: the analysts start as soon as the first one is stored.
    for row in rows:
        entry = {"company": "ACME", **row, "quarters_total": len(rows)}
        flotilla("ws", "write", FIGURES, json.dumps(entry))
    return {
        "response": f"Wrote {len(rows)} quarters of ACME figures ({rows[0]['quarter']} to {rows[-1]['quarter']}) to the workspace.",
        "numeric_value": rows[-1]["revenue"],
        "tools_used": ["csv_reader", "workspace"],
    }


def quarters(envelope):
    """Every quarter fetch_data writes, in order. The envelope carries the entries stored when
    this task was dispatched; `flotilla ws watch` streams the ones written after. A retried
    fetch_data writes its quarters again: keeping the last entry per quarter makes that
    harmless."""
    consumed = envelope.get("consumed", {}).get(topic_key(FIGURES), {})
    found, total = {}, None

    def take(entry):
        nonlocal total
        if "quarter" in entry:  # Flotilla's own entry from fetch_data's result has none
            found[entry["quarter"]] = entry
            total = entry.get("quarters_total", total)

    for e in consumed.get("entries", []):
        take(e["entry"])
    if total is None or len(found) < total:
        watch = subprocess.Popen(
            [FLOTILLA, "ws", "watch", FIGURES, "--since", str(consumed.get("next_since_seq", 0)),
             "--timeout", str(WATCH_TIMEOUT_SECS)],
            stdout=subprocess.PIPE, text=True,
        )
        for line in watch.stdout:
            take(json.loads(line)["entry"])
            if total is not None and len(found) >= total:
                break
        watch.kill()
        watch.wait()
    if total is None or len(found) < total:
        sys.exit(f"only {len(found)} of {total or '?'} quarters arrived on topic {FIGURES!r}")
    return [found[q] for q in sorted(found)]


def growth(envelope):
    q = quarters(envelope)
    prev, last = q[-2], q[-1]
    pct = (last["revenue"] / prev["revenue"] - 1.0) * 100.0
    return {
        "response": f"Revenue grew {pct:.1f}% quarter over quarter "
        f"({prev['quarter']}: {prev['revenue']:,.1f} -> {last['quarter']}: {last['revenue']:,.1f}).",
        "numeric_value": round(pct, 1),
    }


def margin(envelope):
    last = quarters(envelope)[-1]
    pct = last["net_income"] / last["revenue"] * 100.0
    return {
        "response": f"Net margin in {last['quarter']} was {pct:.1f}% "
        f"(net income {last['net_income']:,.1f} on revenue {last['revenue']:,.1f}).",
        "numeric_value": round(pct, 1),
    }


def figure(envelope, topic):
    """The numeric_value of the entry Flotilla wrote to `topic` from its producer's result."""
    entries = envelope.get("consumed", {}).get(topic_key(topic), {}).get("entries", [])
    values = [e["entry"].get("numeric_value") for e in entries]
    values = [v for v in values if v is not None]
    if not values:
        sys.exit(f"topic {topic!r} holds no entry with a numeric_value")
    return values[-1]


def report(envelope):
    g, m = figure(envelope, "growth"), figure(envelope, "margin")
    pace = "strong" if g >= 5 else "modest" if g >= 0 else "negative"
    health = "healthy" if m >= 8 else "thin" if m >= 0 else "loss-making"
    return "\n".join(
        [
            "ACME quarterly earnings report",
            f"- Revenue growth: {g:+.1f}% quarter over quarter ({pace})",
            f"- Net margin: {m:.1f}% ({health})",
            f"Assessment: {pace} top-line momentum with a {health} margin.",
        ]
    )


def main():
    step = sys.argv[1] if len(sys.argv) > 1 else ""
    envelope = json.load(sys.stdin)
    if step == "fetch":
        out = fetch(envelope, sys.argv[2])
    elif step == "growth":
        out = growth(envelope)
    elif step == "margin":
        out = margin(envelope)
    elif step == "report":
        out = report(envelope)
    else:
        sys.exit(f"unknown step {step!r}: use fetch, growth, margin or report")
    print(json.dumps(out) if isinstance(out, dict) else out)


if __name__ == "__main__":
    main()
