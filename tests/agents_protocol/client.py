#!/usr/bin/env python3
"""A caller of the NATS Agent Protocol (v0.3), written from the protocol's documentation only:
the synadia-agents README's "Wire protocol at a glance", docs/using-nats-cli.md and the client
SDKs' protocol-mapping tables. It uses nothing of Flotilla: plain nats-py.

    client.py URL discover                      -> JSON list of `agents` service instances
    client.py URL heartbeat AGENT [SECONDS]     -> the first heartbeat of AGENT seen
    client.py URL status SUBJECT                -> the status endpoint's answer
    client.py URL prompt SUBJECT BODY [--answer TEXT] [--timeout S]
                                                -> {"chunks": [...], "errors": [...], "terminated": bool}
    client.py URL cancel SUBJECT BODY           -> prompts, unsubscribes after the first
                                                   response chunk (or the ack), prints what it saw
    client.py URL raw SUBJECT HEX               -> sends HEX bytes as the prompt, prints the stream

Every command prints one JSON document on stdout. `prompt` sends BODY verbatim: plain text is
the protocol's shorthand for {"prompt": BODY}; a JSON object is sent as the envelope.
"""

import argparse
import asyncio
import json
import sys
import time

import nats


async def connect(url):
    return await nats.connect(url, allow_reconnect=False, connect_timeout=5)


async def discover(nc, wait=1.0):
    """$SRV.INFO.agents gathers every instance of the `agents` micro service (section 4)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.flush()
    await nc.publish("$SRV.INFO.agents", b"", reply=inbox)
    found = []
    deadline = time.monotonic() + wait
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            msg = await sub.next_msg(timeout=left)
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            break
        info = json.loads(msg.data)
        if info.get("name") == "agents":
            found.append(info)
    await sub.unsubscribe()
    return found


def decode(msg):
    """One stream message: the terminator (empty body, no headers), an error frame
    (Nats-Service-Error-Code header), or a typed JSON chunk."""
    headers = msg.headers or {}
    if not msg.data and not headers:
        return ("end", None)
    if "Nats-Service-Error-Code" in headers:
        body = None
        if msg.data:
            try:
                body = json.loads(msg.data)
            except ValueError:
                body = msg.data.decode("utf-8", "replace")
        return ("error", {
            "code": int(headers["Nats-Service-Error-Code"]),
            "description": headers.get("Nats-Service-Error", ""),
            "body": body,
        })
    chunk = json.loads(msg.data)
    if not isinstance(chunk, dict) or not isinstance(chunk.get("type"), str):
        raise ValueError("a chunk without a type: %r" % msg.data)
    return ("chunk", chunk)


async def stream(nc, subject, body, answer=None, timeout=30.0, cancel_after_first=False):
    """Subscribe to a fresh inbox first, flush, then publish the prompt with that reply
    subject (section 6.1); read chunks until the terminator; answer a `query` on its
    reply_subject (section 7)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.flush()
    await nc.publish(subject, body, reply=inbox)
    out = {"chunks": [], "errors": [], "terminated": False, "queries": []}
    while True:
        try:
            msg = await sub.next_msg(timeout=timeout)
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            out["timed_out"] = True
            break
        kind, value = decode(msg)
        if kind == "end":
            out["terminated"] = True
            break
        if kind == "error":
            out["errors"].append(value)
            continue
        out["chunks"].append(value)
        if value["type"] == "query":
            q = value["data"]
            out["queries"].append(q)
            if answer is not None:
                await nc.publish(q["reply_subject"], answer.encode())
                await nc.flush()
        if cancel_after_first and value["type"] == "response":
            # The protocol has no cancel message: the caller stops listening.
            await sub.unsubscribe()
            out["cancelled"] = True
            return out
    await sub.unsubscribe()
    return out


async def heartbeat(nc, agent, wait):
    sub = await nc.subscribe("agents.hb.%s.*.*" % agent)
    await nc.flush()
    try:
        msg = await sub.next_msg(timeout=wait)
    except (asyncio.TimeoutError, nats.errors.TimeoutError):
        return None
    finally:
        await sub.unsubscribe()
    return {"subject": msg.subject, "payload": json.loads(msg.data)}


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    sp = p.add_subparsers(dest="cmd", required=True)
    sp.add_parser("discover")
    h = sp.add_parser("heartbeat")
    h.add_argument("agent")
    h.add_argument("wait", type=float, nargs="?", default=5.0)
    s = sp.add_parser("status")
    s.add_argument("subject")
    for name in ("prompt", "cancel"):
        c = sp.add_parser(name)
        c.add_argument("subject")
        c.add_argument("body")
        c.add_argument("--answer")
        c.add_argument("--timeout", type=float, default=30.0)
    r = sp.add_parser("raw")
    r.add_argument("subject")
    r.add_argument("hex")
    args = p.parse_args()
    nc = await connect(args.url)
    try:
        if args.cmd == "discover":
            result = await discover(nc)
        elif args.cmd == "heartbeat":
            result = await heartbeat(nc, args.agent, args.wait)
        elif args.cmd == "status":
            msg = await nc.request(args.subject, b"", timeout=5)
            result = json.loads(msg.data)
        elif args.cmd == "prompt":
            result = await stream(nc, args.subject, args.body.encode(), args.answer, args.timeout)
        elif args.cmd == "cancel":
            result = await stream(nc, args.subject, args.body.encode(), None, args.timeout, True)
        else:
            result = await stream(nc, args.subject, bytes.fromhex(args.hex))
    finally:
        await nc.drain()
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    asyncio.run(main())
