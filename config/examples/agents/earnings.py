#!/usr/bin/env python3
"""Agents of the earnings-analysis example, run by Flotilla's `exec` agent.

Each invocation receives the task envelope as JSON on stdin and prints its answer on stdout
(plain text, or a JSON object with "response" and optional "numeric_value" / "tools_used").
A non-zero exit fails the task. Standard library only.

    earnings.py fetch CSV   -> the quarterly figures, as JSON text
    earnings.py growth      -> quarter-over-quarter revenue growth, from fetch_data's result
    earnings.py margin      -> latest net margin, from fetch_data's result
    earnings.py report      -> the report, from calc_growth's and calc_margin's numeric_value
"""
import csv
import json
import sys


def quarters(envelope):
    fetched = envelope["dependency_results"]["fetch_data"]["response"]
    return json.loads(fetched)["quarters"]


def fetch(envelope, path):
    with open(path, newline="") as f:
        rows = [
            {"quarter": r["quarter"], "revenue": float(r["revenue"]), "net_income": float(r["net_income"])}
            for r in csv.DictReader(f)
        ]
    if len(rows) < 2:
        sys.exit(f"{path}: need at least two quarters, found {len(rows)}")
    return {
        "response": json.dumps({"company": "ACME", "quarters": rows}),
        "numeric_value": rows[-1]["revenue"],
        "tools_used": ["csv_reader"],
    }


def growth(envelope):
    q = quarters(envelope)
    prev, last = q[-2], q[-1]
    pct = (last["revenue"] / prev["revenue"] - 1.0) * 100.0
    return (
        f"Revenue grew {pct:.1f}% quarter over quarter "
        f"({prev['quarter']}: {prev['revenue']:,.1f} -> {last['quarter']}: {last['revenue']:,.1f})."
    )


def margin(envelope):
    last = quarters(envelope)[-1]
    pct = last["net_income"] / last["revenue"] * 100.0
    return (
        f"Net margin in {last['quarter']} was {pct:.1f}% "
        f"(net income {last['net_income']:,.1f} on revenue {last['revenue']:,.1f})."
    )


def report(envelope):
    deps = envelope["dependency_results"]
    g = deps["calc_growth"].get("numeric_value")
    m = deps["calc_margin"].get("numeric_value")
    if g is None or m is None:
        sys.exit("calc_growth and calc_margin must both report a numeric_value")
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
