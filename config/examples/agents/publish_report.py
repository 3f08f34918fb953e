#!/usr/bin/env python3
"""The `publisher` exec agent of the market-analysis example (config/examples/market-analysis.toml).

It runs the plan's `publish_report` task, whose `"action": "publish"` makes Flotilla wait for
a person's approval before dispatching it: this script only ever runs once someone approved
(`flotilla approvals approve RUN t4a1 --by you`). A rejected publication never reaches it.

Flotilla writes the task envelope as JSON on stdin; the writer's report is the result of the
task this one depends on (`dependency_results`). It is published by writing it as Markdown to
the file named by $MARKET_REPORT_PATH (default: flotilla-market-report.md in the system's
temporary directory) — atomically, so a reader never sees half a report, and a retried
attempt replaces the file (only its footer's time differs). The writer answers in JSON (title, summary,
recommendation: the plan's output_schema); any other text is published as it is.

Stdout is the task's result: where the report went. Standard library only.
"""
import datetime
import json
import os
import sys
import tempfile

DEFAULT_PATH = os.path.join(tempfile.gettempdir(), "flotilla-market-report.md")


def report_of(envelope):
    deps = envelope.get("dependency_results") or {}
    result = deps.get("write_report")
    if result is None and len(deps) == 1:
        result = next(iter(deps.values()))
    if result is None:
        sys.exit(f"no report to publish: the task depends on {sorted(deps)}, not write_report")
    if not result.get("success", False):
        sys.exit("the report task did not succeed; nothing is published")
    text = (result.get("response") or "").strip()
    if not text:
        sys.exit("the report is empty; nothing is published")
    return text


def markdown(text, envelope):
    try:
        report = json.loads(text)
    except json.JSONDecodeError:
        report = None
    if isinstance(report, dict) and ("title" in report or "summary" in report):
        title = str(report.get("title") or "").strip() or "Market report"
        parts = [f"# {title}", "", str(report.get("summary") or "").strip()]
        recommendation = str(report.get("recommendation") or "").strip()
        if recommendation:
            parts += ["", f"**Recommendation:** {recommendation}"]
        body = "\n".join(parts)
    else:
        title = text.splitlines()[0].lstrip("# ").strip()[:80] or "Market report"
        body = text
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    footer = f"\n\n---\nPublished by Flotilla run {envelope.get('run_id', '?')} at {when}.\n"
    return title, body + footer


def publish(path, content):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".market-report-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(content)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a published report is for reading
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def main():
    envelope = json.load(sys.stdin)
    title, content = markdown(report_of(envelope), envelope)
    path = os.environ.get("MARKET_REPORT_PATH") or DEFAULT_PATH
    publish(path, content)
    print(json.dumps({
        "response": f"Published \"{title}\" to {path} ({len(content.encode('utf-8'))} bytes).",
        "tools_used": ["file"],
    }))


if __name__ == "__main__":
    main()
