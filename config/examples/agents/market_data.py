#!/usr/bin/env python3
"""The `market_data` exec tool of the market-analysis example (config/examples/market-analysis.toml).

An LLM agent calls it like any tool: Flotilla writes the call's arguments as a JSON object on
stdin, e.g. {"dataset": "competitors"}, and gives the model what this prints on stdout.

It serves the small, made-up data set about the Norland cargo e-bike market in
config/examples/data/market/ (or the directory named by $MARKET_DATA_DIR): `sales` (units and
revenue per year), `competitors` (market shares, prices, growth) and `notes` (trends). Without
a `dataset` (or with "all") it returns all three. Standard library only; deterministic.
"""
import csv
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.environ.get("MARKET_DATA_DIR", os.path.join(HERE, "..", "data", "market"))
DATASETS = ("sales", "competitors", "notes")


def rows(name):
    with open(os.path.join(DATA, f"{name}.csv"), newline="", encoding="utf-8") as f:
        return [{k: v for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def notes():
    with open(os.path.join(DATA, "notes.txt"), encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[1:]  # the first line is the file's title


def load(name):
    return notes() if name == "notes" else rows(name)


def main():
    raw = sys.stdin.read()
    try:
        args = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as e:
        print(f"arguments are not JSON: {e}", file=sys.stderr)
        return 2
    if not isinstance(args, dict):
        print("arguments must be a JSON object such as {\"dataset\": \"sales\"}", file=sys.stderr)
        return 2
    wanted = str(args.get("dataset") or "all").strip().lower()
    if wanted == "all":
        names = DATASETS
    elif wanted in DATASETS:
        names = (wanted,)
    else:
        print(json.dumps({"error": f"unknown dataset {wanted!r}", "datasets": ["all", *DATASETS]}))
        return 0
    out = {"market": "cargo e-bikes in Norland (made-up figures)"}
    for name in names:
        out[name] = load(name)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
