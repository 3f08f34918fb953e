#!/usr/bin/env python3
"""A minimal MCP server for Flotilla's tests (standard library only).

    mcp_server.py stdio      JSON-RPC over stdin/stdout, one message per line
    mcp_server.py http       streamable HTTP on a free loopback port (printed as `PORT <n>`),
                             answering POST /mcp with JSON

Tools: `add` (structured result), `shout` (text result), `fail` (an isError result),
`hidden` (for allow-list tests). Every tools/call is appended to $MCP_LOG as a JSON line.
"""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOOLS = [
    {
        "name": "add",
        "description": "Adds two numbers",
        "inputSchema": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
    {
        "name": "shout",
        "description": "Upper-cases a text",
        "inputSchema": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
    },
    {"name": "fail", "description": "Always fails", "inputSchema": {"type": "object"}},
    {"name": "hidden", "description": "Not allowed", "inputSchema": {"type": "object"}},
]


def log_call(name, args):
    path = os.environ.get("MCP_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"tool": name, "arguments": args}) + "\n")


def call(name, args):
    log_call(name, args)
    if name == "add":
        total = args["a"] + args["b"]
        return {"content": [{"type": "text", "text": str(total)}], "structuredContent": {"sum": total}}
    if name == "shout":
        return {"content": [{"type": "text", "text": args["text"].upper()}]}
    if name == "fail":
        return {"content": [{"type": "text", "text": "disk on fire"}], "isError": True}
    return {"content": [{"type": "text", "text": "hidden"}]}


def handle(msg):
    """The response to one JSON-RPC message, or None for a notification."""
    if "id" not in msg:
        return None
    method, params, rid = msg.get("method"), msg.get("params") or {}, msg["id"]
    if method == "initialize":
        result = {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "flotilla-test-mcp", "version": "1.0"},
        }
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call":
        result = call(params["name"], params.get("arguments") or {})
    elif method == "ping":
        result = {}
    else:
        return {"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": f"no method {method}"}}
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def stdio():
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        response = handle(json.loads(line))
        if response is not None:
            sys.stdout.write(json.dumps(response) + "\n")
            sys.stdout.flush()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        response = handle(json.loads(body))
        if response is None:
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = json.dumps(response).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.send_response(405)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_DELETE = do_GET


def http():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    http() if sys.argv[1:] == ["http"] else stdio()
