#!/usr/bin/env python3
"""Deterministic sub-agents of the workflow example (config/examples/workflows.toml).

They are plain programs, not models: each reads its task envelope (JSON on stdin) and prints
its answer, so the workflow machinery can be watched without an LLM. The workflow agents
pass each step `input.previous_results` (the steps before it), `input.iteration` (loops) and
`input.branch`, and `input.dependency_results` (the workflow task's dependencies in the plan).

    editorial.py source <name>   a parallel branch: one finding about the product
    editorial.py summarize       the branches' findings (the step before it) in one line
    editorial.py draft           a draft from the research (the plan dependency `research`)
    editorial.py critique        the draft before it, with what it lacks
    editorial.py write           the reviewed draft (`draft_review`), fixed from iteration 2
    editorial.py judge           escalates (ends the loop) once the text gives the weight
"""

import json
import sys

task = json.load(sys.stdin)
inp = task.get("input") or {}
prev = inp.get("previous_results") or []
# The workflow task's own plan dependencies arrive in input.dependency_results.
deps = inp.get("dependency_results") or task.get("dependency_results") or {}
role = sys.argv[1]

def dependency(name):
    return (deps.get(name) or {}).get("response", "")


if role == "source":
    name = sys.argv[2]
    facts = {
        "market": "the market for sailing dinghies grew 12% last year",
        "customers": "customers ask first about weight and price",
    }
    print(f"{name}: {facts.get(name, 'no finding')}")
elif role == "summarize":
    gathered = json.loads(prev[-1]["response"]) if prev else {}
    print("Research: " + "; ".join(gathered[k] for k in sorted(gathered)))
elif role == "draft":
    research = dependency("research")
    growth = " in a market that grew 12% last year" if "12%" in research else ""
    print(f"A light, affordable dinghy{growth}.")
elif role == "critique":
    draft = prev[-1]["response"] if prev else ""
    print(json.dumps({"draft": draft, "critique": "say the weight in kilograms"}))
elif role == "write":
    review = json.loads(dependency("draft_review") or "{}")
    text = review.get("draft", "")
    it = inp.get("iteration", 1)
    if it >= 2 and "kilograms" in review.get("critique", ""):
        text += " It weighs 45 kg."
    print(text)
elif role == "judge":
    text = prev[-1]["response"] if prev else ""
    good = "kg" in text
    print(json.dumps({"escalate": good, "verdict": "ready" if good else "needs the weight", "text": text}))
else:
    sys.exit(f"unknown role {role}")
