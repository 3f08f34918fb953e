#!/usr/bin/env python3
"""An agent of the NATS Agent Protocol (v0.3), written from the protocol's documentation only
(the synadia-agents README's "Wire protocol at a glance", docs/using-nats-cli.md, the SDKs'
protocol-mapping tables), with plain nats-py and nothing of Flotilla. A deterministic test
agent, not a model: it answers "<agent> says: <prompt>" in two response chunks.

    agent.py URL AGENT OWNER [--die-after-first-chunk] [--no-heartbeat] [--capabilities CSV]
             [--ask-permission] [--ready-file PATH]

It registers as an instance of the `agents` micro service by answering $SRV.PING / $SRV.INFO
itself, serves `prompt` on agents.prompt.AGENT.OWNER.default and `status` on
agents.status.AGENT.OWNER.default (queue group `agents`), and beats every second on agents.hb.AGENT.OWNER.default. With --die-after-first-chunk it stops
beating and answering after a prompt's first response chunk: a dead agent mid-call. With
--no-heartbeat it registers (answers $SRV.INFO) but never beats nor answers `status`: a stuck
agent. --capabilities sets metadata.capabilities (default `echo`). With --ask-permission it asks
the caller for permission after its first chunk, as the protocol frames it: a `query` chunk
{"id", "reply_subject" (a fresh inbox it subscribed first), "prompt"}, and waits up to 120 s for
the answer (plain text, or an envelope {"prompt": ...}); its second chunk is then
"permission <answer>" ("permission none" when nobody answered: its default, deny).
"""

import argparse
import asyncio
import json
import os
import secrets
from datetime import datetime, timezone

import nats

SESSION = "default"
INTERVAL_S = 1


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("agent")
    p.add_argument("owner")
    p.add_argument("--die-after-first-chunk", action="store_true")
    p.add_argument("--no-heartbeat", action="store_true")
    p.add_argument("--capabilities", default="echo")
    p.add_argument("--ask-permission", action="store_true")
    p.add_argument("--ready-file")
    args = p.parse_args()
    nc = await nats.connect(args.url)
    instance = secrets.token_hex(11)
    tokens = "%s.%s.%s" % (args.agent, args.owner, SESSION)
    prompt_subject = "agents.prompt." + tokens
    metadata = {"agent": args.agent, "owner": args.owner, "session": SESSION,
                "protocol_version": "0.3", "capabilities": args.capabilities}
    info = {
        "type": "io.nats.micro.v1.info_response",
        "name": "agents", "id": instance, "version": "0.0.1",
        "description": "A test agent that repeats the prompt",
        "metadata": metadata,
        "endpoints": [{"name": "prompt", "subject": prompt_subject, "queue_group": "agents",
                       "metadata": {"max_payload": "1MB", "attachments_ok": "false"}},
                      {"name": "status", "subject": "agents.status." + tokens,
                       "queue_group": "agents", "metadata": None}],
    }
    ping = {"type": "io.nats.micro.v1.ping_response", "name": "agents", "id": instance,
            "version": "0.0.1", "metadata": metadata}
    dead = asyncio.Event()

    async def answer(doc):
        async def handler(msg):
            if msg.reply and not dead.is_set():
                await nc.publish(msg.reply, json.dumps(doc).encode())
        return handler

    for verb, doc in (("PING", ping), ("INFO", info)):
        for subject in ("$SRV.%s" % verb, "$SRV.%s.agents" % verb, "$SRV.%s.agents.%s" % (verb, instance)):
            await nc.subscribe(subject, cb=await answer(doc))

    async def chunk(reply, kind, data):
        await nc.publish(reply, json.dumps({"type": kind, "data": data}).encode())

    async def on_prompt(msg):
        if dead.is_set() or not msg.reply:
            return
        text = msg.data.decode("utf-8", "replace")
        if text.lstrip().startswith("{"):
            try:
                text = json.loads(text).get("prompt", "")
            except ValueError:
                pass
        if not text.strip():
            await nc.publish(msg.reply, b"", headers={"Nats-Service-Error-Code": "400",
                                                      "Nats-Service-Error": "prompt missing or empty"})
            await nc.publish(msg.reply, b"")
            return
        await chunk(msg.reply, "status", "ack")
        await chunk(msg.reply, "response", "%s says: " % args.agent)
        await nc.flush()
        if args.die_after_first_chunk:
            dead.set()
            return
        if args.ask_permission:
            inbox = nc.new_inbox()
            answers = await nc.subscribe(inbox, max_msgs=1)
            await nc.flush()
            await chunk(msg.reply, "query", {"id": "perm-" + secrets.token_hex(4),
                                             "reply_subject": inbox,
                                             "prompt": "May I delete /tmp/stale? (yes/no)"})
            await nc.flush()
            try:
                answer = await answers.next_msg(timeout=120)
                said = answer.data.decode("utf-8", "replace")
                if said.lstrip().startswith("{"):
                    said = json.loads(said).get("prompt", "")
            except (nats.errors.TimeoutError, ValueError):
                said = "none"
            await chunk(msg.reply, "response", "permission " + said.strip())
        else:
            await asyncio.sleep(0.2)
            await chunk(msg.reply, "response", text)
        await nc.publish(msg.reply, b"")
        await nc.flush()

    await nc.subscribe(prompt_subject, queue="agents", cb=on_prompt)

    def heartbeat():
        return json.dumps({"agent": args.agent, "owner": args.owner, "session": SESSION,
                           "instance_id": instance, "interval_s": INTERVAL_S,
                           "ts": datetime.now(timezone.utc).isoformat()}).encode()

    async def on_status(msg):
        # The status endpoint answers the heartbeat payload, freshly built.
        if msg.reply and not dead.is_set() and not args.no_heartbeat:
            await nc.publish(msg.reply, heartbeat())

    await nc.subscribe("agents.status." + tokens, queue="agents", cb=on_status)

    async def beat():
        while not dead.is_set():
            if args.no_heartbeat:
                await asyncio.sleep(INTERVAL_S)
                continue
            await nc.publish("agents.hb." + tokens, heartbeat())
            await asyncio.sleep(INTERVAL_S)

    beating = asyncio.create_task(beat())
    await nc.flush()
    if args.ready_file:
        with open(args.ready_file, "w") as f:
            f.write(instance)
    await beating
    # Dead: silent, but connected, until killed.
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        os._exit(0)
