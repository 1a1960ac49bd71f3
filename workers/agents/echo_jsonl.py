"""A command-mode example agent in plain Python (no import of the runtime): counts turns and echoes.

Shows the JSON-lines protocol of ``workers/command.py``; an agent in any language does the same.
"""

import json
import sys


def main() -> None:
    turns = 0
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.get("op")
        if op == "start":
            turns = int((msg.get("state") or {}).get("turns", 0))
            reply = {"ok": True}
        elif op == "invoke":
            turns += 1
            reply = {"output": {"echo": msg.get("input"), "turns": turns}}
        elif op == "snapshot":
            reply = {"state": {"turns": turns}}
        elif op == "stop":
            return
        else:
            reply = {"error": f"unknown op {op!r}"}
        if "id" in msg:  # echoed, so the worker can tell this answer from any stray line (workers/command.py)
            reply["id"] = msg["id"]
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
