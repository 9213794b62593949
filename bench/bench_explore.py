"""How fast the explorer starts and answers: `gridtrain explore` from the command to its printed
URL and to its first page, and POST /api/plan for single layouts (every layout choice fixed, as
the page sends them while you change an input), the issue's bars being 2 s and 100 ms.

    python bench/bench_explore.py [--repeats 5] [--burst 50] [--ranked] [--typing]

Startup runs the installed command in a fresh process each time. `--burst N` also sends N plan
searches at once (70B on 512 GPUs, every layout choice left to the search, as a page's burst of
keystrokes would) and GETs the page every 0.25 s while they are in flight: how many were
answered and how, in how long, and the GETs' latency. The layouts are the lecture's
presets and their neighbours; each is asked once cold (the planner's caches empty, as after
startup) and then `--repeats` times warm. Prints medians and maxima in milliseconds.
`--ranked` times ranked searches (every choice left to the search) and says which answered partial
(the explorer's 2.5 s budget); `--typing` types 8192 into the sequence of 70B on 256 GPUs as the
page does (a request per key 450 ms apart, each aborting the one before) and times the last key's
answer.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.explore.server import make_server  # noqa: E402

SEVEN_B = {"model": "llama3-8b", "shape": {"n_kv_heads": 32, "ffn_dim": 11008, "vocab_size": 32000},
           "gpu": "h100", "num_gpus": 8, "seq_len": 4096, "global_batch": 512}
LAYOUTS = {
    "7B, 8 GPUs, pure DP (does not fit)": SEVEN_B | {"layout": {"tp": 1, "pp": 1, "cp": 1, "zero": 0, "mb": 1, "recompute": "none"}},
    "7B, 8 GPUs, ZeRO-3": SEVEN_B | {"layout": {"tp": 1, "pp": 1, "cp": 1, "zero": 3, "dp_shard": 8, "mb": 1, "recompute": "none"}},
    "405B, 128 GPUs, TP 8 + PP 4 + FSDP": {"model": "llama3-405b", "gpu": "h100", "num_gpus": 128, "seq_len": 8192,
                                           "global_batch": 64, "layout": {"tp": 8, "pp": 4, "cp": 1, "zero": 3, "dp_shard": 4,
                                                                          "mb": 1, "schedule": "1f1b", "v": 1, "recompute": "full"}},
    "70B, 64 GPUs, TP 8 + PP 4 interleaved": {"model": "llama3-70b", "gpu": "h100", "num_gpus": 64, "seq_len": 4096,
                                              "global_batch": 512, "layout": {"tp": 8, "pp": 4, "cp": 1, "zero": 2, "mb": 1,
                                                                              "schedule": "interleaved-1f1b", "v": 2,
                                                                              "recompute": "selective"}},
    "70B, 256 GPUs, pure DP (does not fit: fixes)": {"model": "llama3-70b", "gpu": "h100", "num_gpus": 256,
                                                     "seq_len": 8192, "global_batch": 512,
                                                     "layout": {"tp": 1, "pp": 1, "cp": 1, "zero": 0}},
    "405B, 16,384 GPUs, TP 8 + PP 16 + CP 1": {"model": "llama3-405b", "gpu": "h100", "num_gpus": 16384, "seq_len": 8192,
                                               "global_batch": 2048, "layout": {"tp": 8, "pp": 16, "cp": 1, "zero": 2, "mb": 1,
                                                                                "schedule": "interleaved-1f1b", "v": 2,
                                                                                "recompute": "none"}},
}


def startup(repeats: int) -> tuple[list[float], list[float]]:
    """Seconds from the command to its URL line, and to the first page."""
    to_url, to_page = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "gridtrain", "explore"], stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        to_url.append(time.perf_counter() - start)
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/")
        assert conn.getresponse().status == 200
        to_page.append(time.perf_counter() - start)
        conn.close()
        proc.terminate()
        proc.wait()
    return to_url, to_page


def ask(port: int, body: dict) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    start = time.perf_counter()
    conn.request("POST", "/api/plan", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    seconds = time.perf_counter() - start
    conn.close()
    assert response.status == 200, body
    return seconds


RANKED = {f"70B, 256 GPUs, seq {seq}": {"model": "llama3-70b", "gpu": "h100", "num_gpus": 256, "seq_len": seq,
                                        "global_batch": 512, "layout": {}} for seq in (81, 819, 8192)} | {
    "405B, 128 GPUs": {"model": "llama3-405b", "gpu": "h100", "num_gpus": 128, "seq_len": 8192, "global_batch": 64,
                       "layout": {}},
    "405B, 16,384 GPUs": {"model": "llama3-405b", "gpu": "h100", "num_gpus": 16384, "seq_len": 8192,
                          "global_batch": 2048, "layout": {}}}


def ranked(port: int) -> None:
    """Each ranked search once: its time, and whether it answered partial."""
    print(f"{'ranked search':42} {'ms':>8} partial")
    for name, body in RANKED.items():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        start = time.perf_counter()
        conn.request("POST", "/api/plan", json.dumps(body), {"Content-Type": "application/json"})
        data = json.loads(conn.getresponse().read())
        print(f"{name:42} {(time.perf_counter() - start) * 1e3:8.0f} {data.get('partial')}")
        conn.close()


def typing(server, port: int, gap_s: float = 0.45) -> None:  # noqa: ANN001
    """8192 typed key by key on 70B over 256 GPUs: each key's request aborts the one before (the
    connection closed, as the page's AbortController does)."""
    body = RANKED["70B, 256 GPUs, seq 8192"]
    cancelled, conn = server.cancelled, None
    for prefix in ("8", "81", "819", "8192"):
        if conn is not None:
            conn.close()  # the page aborts the superseded request
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        start = time.perf_counter()
        conn.request("POST", "/api/plan", json.dumps(body | {"seq_len": int(prefix)}), {"Content-Type": "application/json"})
        if prefix != "8192":
            time.sleep(gap_s)
    response = conn.getresponse()
    data = json.loads(response.read())
    conn.close()
    print(f"typing 8192 ({gap_s * 1e3:.0f} ms a key): the last key answered in {(time.perf_counter() - start) * 1e3:.0f} "
          f"ms, status {response.status}, partial {data.get('partial')}; {server.cancelled - cancelled} superseded "
          "searches stopped on the server")


SEARCH = {"model": "llama3-70b", "gpu": "h100", "num_gpus": 512, "seq_len": 8192, "global_batch": 512, "layout": {}}


def burst(port: int, count: int) -> None:
    """`count` concurrent searches, one connection each, and GETs of / meanwhile."""
    statuses: list[int] = []
    gets: list[float] = []

    def search() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request("POST", "/api/plan", json.dumps(SEARCH), {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        statuses.append(response.status)
        conn.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=search) for _ in range(count)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        began = time.perf_counter()
        conn.request("GET", "/")
        conn.getresponse().read()
        gets.append(time.perf_counter() - began)
        conn.close()
        time.sleep(0.25)
    total = time.perf_counter() - start
    counts = {code: statuses.count(code) for code in sorted(set(statuses))}
    print(f"burst of {count} searches: answered {len(statuses)} ({counts}) in {total:.1f} s; {len(gets)} GETs "
          f"meanwhile, median {statistics.median(gets) * 1e3:.0f} ms, max {max(gets) * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--burst", type=int, default=0, help="also send this many searches at once")
    parser.add_argument("--ranked", action="store_true", help="also time ranked searches")
    parser.add_argument("--typing", action="store_true", help="also type 8192 into the sequence, key by key")
    args = parser.parse_args()
    to_url, to_page = startup(args.repeats)
    print(f"startup ({args.repeats} runs): URL printed median {statistics.median(to_url) * 1e3:.0f} ms "
          f"(max {max(to_url) * 1e3:.0f}); first page median {statistics.median(to_page) * 1e3:.0f} ms "
          f"(max {max(to_page) * 1e3:.0f})")
    server = make_server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    print(f"{'single layout':42} {'cold ms':>8} {'warm median':>12} {'warm max':>9}")
    for name, body in LAYOUTS.items():
        cold = ask(port, body)
        warm = [ask(port, body) for _ in range(args.repeats)]
        print(f"{name:42} {cold * 1e3:8.1f} {statistics.median(warm) * 1e3:12.1f} {max(warm) * 1e3:9.1f}")
    if args.ranked:
        ranked(port)
    if args.typing:
        time.sleep(1.0)
        typing(server, port)
    if args.burst:
        burst(port, args.burst)
    server.shutdown()


if __name__ == "__main__":
    main()
