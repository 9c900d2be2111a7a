"""Cold start: `kiln serve ARTIFACT` to the first `/ready` 200, several starts in a row.

    .venv/bin/python -m bench.bench_cold_start engines/smollm2 --starts 5

Each start is a fresh process (nothing warm but the OS page cache, as on a restarted replica); the
clock runs from the spawn to the first 200 from /ready, polled every 20 ms. Prints each start, the
median and the range, and with --timeline the server's own log lines stamped with the seconds since
spawn (where the time goes: the KV plan line marks the engine loaded, "ready" the warm-up done).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

KILN = Path(sys.executable).with_name("kiln")
POLL_SECONDS = 0.02


def one_start(artifact: Path, port: int, timeline: bool) -> float:
    t0 = time.monotonic()
    server = subprocess.Popen([str(KILN), "serve", str(artifact), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def echo():
        for line in server.stdout:
            if timeline:
                print(f"  {time.monotonic() - t0:5.2f}  {line.rstrip()[:150]}")

    threading.Thread(target=echo, daemon=True).start()
    try:
        while server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(POLL_SECONDS)
        raise SystemExit(f"kiln serve exited with {server.returncode} before /ready")
    finally:
        server.terminate()
        server.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--port", type=int, default=18123)
    ap.add_argument("--timeline", action="store_true", help="print the server's log lines with their times")
    args = ap.parse_args()
    times = []
    for i in range(args.starts):
        times.append(one_start(args.artifact, args.port, args.timeline))
        print(f"start {i + 1}: /ready after {times[-1]:.2f} s", flush=True)
    print(f"median {statistics.median(times):.2f} s, range {min(times):.2f}-{max(times):.2f} s "
          f"over {len(times)} starts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
