#!/usr/bin/env python3
"""The `search_corpus` exec tool of the research-team example (config/examples/research-team.toml).

An LLM agent calls it like any tool: Flotilla writes the call's arguments as a JSON object on
stdin, e.g. {"query": "turbine costs"}, and gives the model what this prints on stdout.

It searches the small corpus of text files in config/examples/data/brindle/ (or the directory
named by $CORPUS_DIR) the way `grep -i` would, but word by word: a line matches when it holds
any word of the query (words of three letters or more), and lines matching more words come
first. An empty query lists the files with their first line. Standard library only.
"""
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.environ.get("CORPUS_DIR", os.path.join(HERE, "..", "data", "brindle"))
MAX_RESULTS = 8


def documents():
    for name in sorted(os.listdir(CORPUS)):
        if name.endswith(".txt"):
            with open(os.path.join(CORPUS, name), encoding="utf-8") as f:
                yield name, f.read().splitlines()


def main():
    raw = sys.stdin.read()
    try:
        args = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as e:
        print(f"arguments are not JSON: {e}", file=sys.stderr)
        return 2
    if not isinstance(args, dict):
        print("arguments must be a JSON object such as {\"query\": \"costs\"}", file=sys.stderr)
        return 2
    query = str(args.get("query") or "")
    limit = args.get("max_results", MAX_RESULTS)
    if not isinstance(limit, int) or limit < 1:
        limit = MAX_RESULTS
    words = {w for w in re.findall(r"[a-z0-9]+", query.lower()) if len(w) >= 3}

    if not words:
        files = [{"file": name, "title": lines[0] if lines else ""} for name, lines in documents()]
        print(json.dumps({"query": query, "files": files, "hint": "search with a few keywords"}))
        return 0

    hits = []
    for name, lines in documents():
        for number, line in enumerate(lines, 1):
            text = line.lower()
            score = sum(1 for w in words if w in text)
            if score:
                hits.append((-score, name, number, line))
    hits.sort()
    matches = [{"file": n, "line": i, "text": t} for _, n, i, t in hits[:limit]]
    print(json.dumps({"query": query, "matches": matches, "total": len(hits)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
