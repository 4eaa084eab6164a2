"""The math-verify worker: run as a script (``python _math_verify_worker.py``), one JSON request per stdin line.

It imports only math-verify (not torch or rlcore), answers ``{"ok": bool}`` or
``{"error": str}`` per request on the original stdout, and exits when stdin closes or
its parent dies. It has no timeout of its own: the parent kills it when an item runs
too long, which works from any thread of the parent (math-verify's own timeout uses
signals, which work only on the main thread).
"""

import json
import logging
import os
import sys
import threading
import time


def _watch_parent(parent: int) -> None:
    # A runaway sympy computation never reads stdin again, so EOF alone cannot stop it.
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main() -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the replies
    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeout is off
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    from math_verify import parse, verify

    out.write('{"ready": true}\n')
    for line in sys.stdin:
        try:
            req = json.loads(line)
            gold = parse(req["gold"], parsing_timeout=None)
            answer = parse(req["answer"], parsing_timeout=None)
            ok = bool(
                gold
                and answer
                and verify(
                    gold,
                    answer,
                    float_rounding=req["float_rounding"],
                    numeric_precision=req["numeric_precision"],
                    strict=req["strict"],
                    timeout_seconds=None,
                )
            )
            reply: dict[str, object] = {"ok": ok}
        except Exception as err:
            reply = {"error": f"{type(err).__name__}: {err}"}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
