#!/usr/bin/env python3
"""An example MCP server over stdio (standard library only): search and read the text files
of a folder (default: ../data next to this script, or $FILES_ROOT).

Tools:
  search {"query": str}  -> the files whose text contains the query (case-insensitive), with
                            the first matching line of each
  read   {"path": str}   -> a file's text (paths relative to the folder; no escaping it)

Use it from an LLM agent:

    [agents.librarian.mcp-servers.files]
    command = "python3"
    args = ["agents/files_mcp.py"]
"""

import json
import os
import sys

ROOT = os.path.realpath(os.environ.get("FILES_ROOT") or os.path.join(os.path.dirname(__file__), "..", "data"))

TOOLS = [
    {
        "name": "search",
        "description": "Finds the files containing a word or phrase",
        "inputSchema": {
            "type": "object",
            "properties": {"query": {"type": "string", "minLength": 1}},
            "required": ["query"],
        },
    },
    {
        "name": "read",
        "description": "Reads one file found by search",
        "inputSchema": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    },
]


def text_result(value, error=False):
    return {"content": [{"type": "text", "text": value}], "isError": error}


def search(query):
    q, hits = query.lower(), []
    for dirpath, _, files in os.walk(ROOT):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            try:
                with open(path, encoding="utf-8") as f:
                    for line in f:
                        if q in line.lower():
                            hits.append({"path": os.path.relpath(path, ROOT), "line": line.strip()})
                            break
            except (OSError, UnicodeDecodeError):
                continue
    return {"content": [{"type": "text", "text": json.dumps(hits)}], "structuredContent": {"hits": hits}}


def read(path):
    full = os.path.realpath(os.path.join(ROOT, path))
    if not full.startswith(ROOT + os.sep):
        return text_result(f"{path} is outside the folder", error=True)
    try:
        with open(full, encoding="utf-8") as f:
            return text_result(f.read(20000))
    except OSError as e:
        return text_result(f"cannot read {path}: {e.strerror}", error=True)


def handle(msg):
    if "id" not in msg:
        return None
    method, params, rid = msg.get("method"), msg.get("params") or {}, msg["id"]
    if method == "initialize":
        result = {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "flotilla-example-files", "version": "1.0"},
        }
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call":
        args = params.get("arguments") or {}
        name = params.get("name")
        if name == "search":
            result = search(str(args.get("query", "")))
        elif name == "read":
            result = read(str(args.get("path", "")))
        else:
            result = text_result(f"no tool {name}", error=True)
    elif method == "ping":
        result = {}
    else:
        return {"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": f"no method {method}"}}
    return {"jsonrpc": "2.0", "id": rid, "result": result}


for line in sys.stdin:
    line = line.strip()
    if line:
        response = handle(json.loads(line))
        if response is not None:
            sys.stdout.write(json.dumps(response) + "\n")
            sys.stdout.flush()
