"""The explorer's server and JSON API, without a browser: the API answers exactly what
`gridtrain plan --json` prints for the same inputs, junk gets a 4xx with a reason (and the server
keeps serving), the server listens on loopback, answers only to its own names and page (Host,
Origin, a JSON content type), answers a burst of plan requests while still serving GETs, and the
runs view never leaves its folder."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import random
import shlex
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from gridtrain.cli import main
from gridtrain.explore import api
from gridtrain.explore.server import MAX_BODY, make_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    runs = tmp_path_factory.mktemp("runs")
    (runs / "not-a-run").mkdir()
    srv = make_server(runs_dir=runs, timeout=2)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def request(srv, method: str, path: str, body: bytes | str | None = None,
            headers: dict | None = None) -> tuple[int, dict]:
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    data = body.encode() if isinstance(body, str) else body
    headers = ({"Content-Type": "application/json"} if method == "POST" else {}) | (headers or {})
    conn.request(method, path, body=data, headers={k: v for k, v in headers.items() if v is not None})
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, {"raw": raw.decode(errors="replace")}


def cli_plan_json(command: str) -> tuple[int, dict | None, str]:
    """`gridtrain plan ... --json` run through the command line's own entry point."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(shlex.split(command)[1:] + ["--json"])
    text = out.getvalue()
    return code, (json.loads(text) if text.strip() else None), err.getvalue()


def without_timing(plan: dict) -> dict:
    return {**plan, "search": {k: v for k, v in plan["search"].items() if k != "seconds"}} if "search" in plan else plan


def random_body(rng: random.Random) -> dict:
    body = {"model": rng.choice(["llama3-8b", "llama3-70b", "llama3-405b", "small", "m26"]),
            "gpu": rng.choice(["h100", "h200", "a100", "b200"]),
            "num_gpus": rng.choice([8, 16, 64, 128, 512, 2048]),
            "seq_len": rng.choice([2048, 4096, 8192]),
            "global_batch": rng.choice([64, 256, 512, 1024]),
            "precision": rng.choice(["bf16", "bf16", "fp32"])}
    if rng.random() < 0.3:
        body["tokens"] = rng.choice([1e11, 2e12, 15.6e12])
    if rng.random() < 0.3:
        body["shape"] = {"n_layers": rng.choice([8, 16, 24]), "n_kv_heads": rng.choice([8, 32])}
    layout = {}
    for key, values in (("tp", [1, 2, 4, 8]), ("pp", [1, 2, 4]), ("zero", [1, 2, 3]),
                        ("recompute", ["none", "selective", "full"]), ("mb", [1, 2])):
        if rng.random() < 0.35:
            layout[key] = rng.choice(values)
    if layout:
        body["layout"] = layout
    return body


def test_the_api_answers_what_plan_json_prints_for_20_random_inputs(monkeypatch):
    monkeypatch.setattr(api, "SEARCH_SECONDS", 60.0)  # a partial answer (a busy machine) differs by design
    rng, compared, tries = random.Random(16), 0, 0
    fitting = not_fitting = 0
    while compared < 20:
        tries += 1
        assert tries < 200, "too few random inputs the planner takes"
        status, data = api.plan(random_body(rng))
        if status != 200:
            continue
        code, printed, _ = cli_plan_json(data["command"])
        assert printed is not None and code == (0 if printed["fits"] else 2)
        assert without_timing(data["plan"]) == without_timing(printed), data["command"]
        compared += 1
        fitting += printed["fits"]
        not_fitting += not printed["fits"]
    assert fitting and not_fitting  # both kinds of answer were compared


def test_every_recompute_the_page_offers_gets_an_answer():
    for mode in api.LAYOUT["recompute"].choices:
        status, data = api.plan({"model": "llama3-8b", "num_gpus": 8, "layout": {"recompute": mode}})
        assert status == 200, data  # 'attention' is the planner's only: refused for training, with the reason
    assert "gridtrain train refuses" in data["plan"]["reason"]


def test_a_search_that_finds_nothing_in_time_is_a_503_with_the_fix_never_invalid(monkeypatch):
    monkeypatch.setattr(api, "SEARCH_SECONDS", 0.0)
    monkeypatch.setattr(api, "REQUEST_SECONDS", 0.0)
    status, data = api.plan({"model": "llama3-405b", "num_gpus": 8192, "shape": {"vocab_size": 3}})
    assert status == 503 and data["timed_out"]
    assert "ran out of its time" in data["error"] and "fix more of the layout" in data["error"]


SLOW = {"model": "llama3-70b", "num_gpus": 256, "seq_len": 81, "global_batch": 512}
"""A ranked search of seconds: the bound prunes little at 81 tokens (the page's typing of 8192)."""


def test_a_search_out_of_time_answers_its_best_so_far_marked_partial(monkeypatch):
    monkeypatch.setattr(api, "SEARCH_SECONDS", 0.0)
    status, data = api.plan(SLOW)
    assert status == 200 and data["partial"] and data["plan"]["fits"]
    # What it found fits by the planner's own check of that layout alone (a search of one core).
    layout = data["plan"]["chosen"]["layout"]
    fixed = {"tp": layout["tp"], "pp": layout["pp"], "cp": layout["cp"], "zero": layout["zero_stage"],
             "mb": layout["micro_batch"], "dp_shard": layout["dp_shard"], "recompute": layout["recompute"],
             "schedule": layout["pp_schedule"], "v": layout["pp_virtual_stages"]}
    monkeypatch.setattr(api, "SEARCH_SECONDS", 60.0)
    status, alone = api.plan(SLOW | {"layout": fixed})
    assert status == 200 and alone["plan"]["fits"] and not alone["partial"]
    assert alone["plan"]["chosen"]["layout"] == layout


def test_a_search_whose_client_hangs_up_stops(server):
    body = json.dumps(SLOW).encode()
    before = server.cancelled
    sock = socket.create_connection(server.server_address[:2])
    sock.sendall(f"POST /api/plan HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(0.2)  # the search has started
    sock.close()
    deadline = time.monotonic() + 30  # the whole search takes seconds; stopping, a poll (20 ms) and a core
    while server.cancelled == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.cancelled == before + 1
    assert request(server, "POST", "/api/plan", PLAN)[0] == 200  # and the server goes on


def test_a_layout_the_planner_refuses_is_a_422_with_its_reason():
    status, data = api.plan({"model": "llama3-8b", "num_gpus": 8, "layout": {"tp": 3}})
    assert status == 422
    assert "tp=3 cannot split this model" in data["error"] and "choose tp among [1, 2, 4, 8]" in data["error"]


def test_a_mixture_of_experts_is_planned_with_its_ep():
    """The page's ep input is live for a mixture of experts: the options list its experts, a fixed
    ep comes back in the layout with its all-to-alls as a part of the step, and an ep that does not
    divide the experts is a 422 naming the relation."""
    models = api.options()["models"]
    assert models["mixtral-8x7b"]["experts"] == 8 and models["llama3-8b"]["experts"] == 0
    assert models["mixtral-8x7b"]["active_params"] < models["mixtral-8x7b"]["params"]
    status, data = api.plan({"model": "mixtral-8x7b", "num_gpus": 64, "seq_len": 4096, "global_batch": 256,
                             "layout": {"ep": 8}})
    assert status == 200, data
    chosen = data["plan"]["chosen"]
    assert chosen["layout"]["ep"] == 8 and chosen["parts_s"]["ep"] > 0
    assert any(note.startswith("expert parallelism: ep 8") for note in data["plan"]["notes"])
    status, data = api.plan({"model": "mixtral-8x7b", "num_gpus": 64, "layout": {"ep": 3}})
    assert status == 422 and "ep (3) must divide the 8 experts" in data["error"], data


@pytest.mark.parametrize("body, field", [
    ({"num_gpus": 8}, "model: missing"),
    ({"model": "llama3-8b"}, "num_gpus: missing"),
    ({"model": "llama3-8b", "num_gpus": "8"}, "num_gpus: expected a number"),
    ({"model": "llama3-8b", "num_gpus": 10**9}, "num_gpus: 1000000000 is out of range"),
    ({"model": "llama3-8b", "num_gpus": 8, "seq_len": -4096}, "seq_len: -4096 is out of range"),
    ({"model": "llama3-8b", "num_gpus": 8, "shape": {"dim": -5}}, "shape.dim: -5 is out of range"),
    ({"model": "llama3-8b", "num_gpus": 8.5}, "num_gpus: expected a whole number"),
    ({"model": "llama3-8b", "num_gpus": True}, "num_gpus: expected a number"),
    ({"model": "llama3-8b", "num_gpus": 8, "layout": {"zero": 4}}, "layout.zero: 4 is out of range"),
    ({"model": "llama3-8b", "num_gpus": 8, "layout": {"schedule": "fast"}}, "layout.schedule: 'fast' is not one of"),
    ({"model": "llama3-8b", "num_gpus": 8, "layout": [1, 2]}, "layout: expected an object"),
    ({"model": "gpt5", "num_gpus": 8}, "model: 'gpt5' is not one of"),
    ({"model": "llama3-8b", "num_gpus": 8, "hbm_usable": 0}, "hbm_usable: 0 is out of range"),
    ({"model": "llama3-8b", "num_gpus": 8, "tokens": float("inf")}, "tokens: inf is not a finite number"),
    ({"model": "llama3-8b", "num_gpus": float("inf")}, "num_gpus: inf is not a finite number"),
    ({"model": "llama3-8b", "num_gpus": 8, "layout": {"tp": float("nan")}}, "layout.tp: nan is not a finite number"),
    ({"model": "llama3-8b", "num_gpus": 8, "shape": {"dim": 1e400}}, "shape.dim: inf is not a finite number"),
    ({"model": "llama3-8b", "num_gpus": 8, "layout": 0}, "layout: expected an object"),
    ({"model": "llama3-8b", "num_gpus": 8, "colour": "red"}, "colour: unknown field"),
    ([1, 2, 3], "must be a JSON object"),
])
def test_bad_requests_get_a_400_naming_the_field(server, body, field):
    status, data = request(server, "POST", "/api/plan", json.dumps(body))
    assert status == 400 and field in data["error"], data


def test_junk_gets_a_4xx_and_the_server_keeps_serving(server):
    assert request(server, "POST", "/api/plan", "{not json")[0] == 400
    assert request(server, "POST", "/api/plan", b"\xff\xfe\x00junk")[0] == 400
    status, data = request(server, "POST", "/api/plan", "x" * (MAX_BODY + 1))
    assert status == 413 and "at most" in data["error"]
    assert request(server, "POST", "/api/plan", "{}", {"Content-Length": "-5"})[0] in (400, 413)
    assert request(server, "POST", "/api/nothing", "{}")[0] == 404
    assert request(server, "GET", "/api/nothing")[0] == 404
    assert request(server, "PUT", "/api/plan", "{}")[0] == 405
    assert request(server, "DELETE", "/")[0] == 405
    assert request(server, "GET", "/static/../../../../etc/passwd")[0] == 404
    assert request(server, "GET", "/static/%2e%2e/api.py")[0] == 404
    assert request(server, "POST", "/api/cards/ring", json.dumps({"N": "eight"}))[0] == 400
    assert request(server, "POST", "/api/cards/ring", json.dumps({"N": 1e30}))[0] == 400
    assert request(server, "POST", "/api/cards/nope", "{}")[0] == 404
    assert request(server, "POST", "/api/plan", "[" * 30000 + "]" * 30000)[0] == 400  # too deep for json
    assert request(server, "POST", "/api/plan", "{}", {"Content-Length": "1_0"})[0] == 400
    assert request(server, "POST", "/api/plan", "{}", {"Content-Length": "100"})[0] in (400, 408)  # 2 bytes came
    assert request(server, "GET", "/static/%00")[0] == 404
    assert request(server, "GET", "/static/" + "a" * 5000)[0] == 404
    status, data = request(server, "TRACE", "/")
    assert status == 501 and "error" in data  # http.server's own refusals are JSON too
    assert request(server, "GET", "/api/runs/..")[0] == 404
    assert request(server, "GET", "/api/runs/not-a-run")[0] == 404
    # ... and the next good request is answered.
    status, data = request(server, "POST", "/api/plan", json.dumps({"model": "llama3-8b", "num_gpus": 8}))
    assert status == 200 and data["plan"]["fits"]
    status, page = request(server, "GET", "/")
    assert status == 200 and "gridtrain explore" in page["raw"]


def test_the_server_listens_on_loopback_by_default(server):
    assert server.server_address[0] == "127.0.0.1"
    from gridtrain.cli import build_parser
    assert build_parser().parse_args(["explore"]).host == "127.0.0.1"


def test_a_card_answers_new_inputs(server):
    # Ring all-reduce of 2 GB over 16 GPUs at 50 GB/s, 5 us per step: 2 x 2 x 15/16 = 3.75 GB per
    # GPU; 3.75 GB / 50 GB/s = 75 ms plus 30 steps x 5 us = 75.15 ms.
    status, data = request(server, "POST", "/api/cards/ring", json.dumps({"N": 16}))
    assert status == 200
    answers = {a["label"]: a["value"] for a in data["answers"]}
    assert answers["bytes each GPU sends"] == pytest.approx(3.75)
    assert answers["time"] == pytest.approx(75.15)
    assert answers["steps"] == 30


def test_a_mixture_of_experts_run_shows_its_expert_load(tmp_path, corpus_dir):
    """The runs view draws each MoE layer's load over the steps, as the trainer logged it, and links
    the run's layout, ep included, to its plan."""
    from conftest import tiny_overrides

    from gridtrain.explore.runs import run_page

    items = tiny_overrides(tmp_path, corpus_dir) | {"model.preset": "tiny-moe", "run_dir": str(tmp_path / "runs" / "moe"),
                                                   "metrics.log_every": 1}
    assert main(["train", *[a for k, v in items.items() for a in (f"--{k}", str(v).lower())]]) == 0
    status, run = run_page(tmp_path / "runs", "moe")
    assert status == 200, run
    loads = run["curves"]["expert_load"]
    assert sorted(loads) == ["layer0", "layer1"] and len(loads["layer0"]) == len(run["curves"]["step"])
    logged = [json.loads(line) for line in (tmp_path / "runs" / "moe" / "metrics.jsonl").read_text().splitlines()]
    assert loads["layer1"] == [r["moe/load/layer1"] for r in logged if "moe/load/layer1" in r]
    assert all(1 <= x <= 8 / 2 for x in loads["layer0"])  # max / mean of 8 experts at top-2


def test_the_runs_view_without_a_folder_says_how_to_give_one():
    from gridtrain.explore import runs
    status, data = runs.run_list(None)
    assert status == 200 and data["runs"] == [] and "--runs DIR" in data["note"]
    assert runs.run_page(None, "x")[0] == 404
    assert runs.run_list(Path("/nonexistent-folder"))[0] == 404


PLAN = json.dumps({"model": "llama3-8b", "num_gpus": 16})
"""A plan request whose search takes about 0.15 s on one core."""


@pytest.mark.alone  # GETs under a second, searches within 3 s (tests/workers.py)
def test_50_plan_requests_at_once_are_all_answered_and_gets_meanwhile_are_quick(server, monkeypatch):
    # The 50 searches are about 7 s of CPU in all: computed all at once, many ran out of a 3 s
    # budget and a GET waited seconds; queued, each search's budget starts when it does.
    monkeypatch.setattr(api, "REQUEST_SECONDS", 3.0)
    statuses: list[object] = []

    def ask() -> None:
        try:
            statuses.append(request(server, "POST", "/api/plan", PLAN)[0])
        except OSError as e:  # a reset connection
            statuses.append(repr(e))

    threads = [threading.Thread(target=ask) for _ in range(50)]
    for thread in threads:
        thread.start()
    latencies: list[tuple[str, float, int]] = []
    while len(statuses) < 50 and len(latencies) < 10:
        time.sleep(0.2)
        path = ("/", "/api/options")[len(latencies) % 2]
        start = time.perf_counter()
        assert request(server, "GET", path)[0] == 200
        latencies.append((path, round(time.perf_counter() - start, 3), 50 - len(statuses)))
    for thread in threads:
        thread.join(timeout=60)
    assert max((seconds for _, seconds, _ in latencies), default=0) < 1.0, latencies  # (path, s, plans in flight)
    assert sorted(statuses, key=str) == [200] * 50
    assert len(latencies) >= 3 and latencies[2][2] > 0, f"too few GETs while plans were in flight: {latencies}"


def assert_refused(server, status: int, method: str, path: str, headers: dict, word: str) -> None:
    got, data = request(server, method, path, PLAN if method == "POST" else None, headers)
    assert got == status and word in data["error"], (method, path, headers, got, data)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example:{port}",
                                  "localhost.:{port}", "127.0.0.1:1{port}", ""])
def test_a_request_naming_another_host_is_refused_whatever_it_asks(server, host):
    headers = {"Host": host.format(port=server.server_address[1])}
    for method, path in [("GET", "/"), ("GET", "/static/app.js"), ("GET", "/api/runs"), ("GET", "/api/options"),
                         ("POST", "/api/plan"), ("POST", "/api/cards/ring"), ("PUT", "/api/plan")]:
        assert_refused(server, 421, method, path, headers, "is not a name of this server")


def test_the_server_answers_to_its_loopback_names_with_or_without_its_port(server):
    port = server.server_address[1]
    for host in ["127.0.0.1", f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}"]:
        assert request(server, "GET", "/api/options", headers={"Host": host})[0] == 200, host
        assert request(server, "POST", "/api/plan", PLAN, {"Host": host})[0] == 200, host


def test_a_post_from_another_origin_is_refused(server):
    port = server.server_address[1]
    for origin in ["http://evil.example", f"http://evil.example:{port}", "null", f"https://127.0.0.1:{port}",
                   "http://127.0.0.1", f"http://localhost:{port + 1}"]:
        assert_refused(server, 403, "POST", "/api/plan", {"Origin": origin}, "is not this server's page")
        assert_refused(server, 403, "POST", "/api/cards/ring", {"Origin": origin}, "is not this server's page")
    for origin in [f"http://127.0.0.1:{port}", f"http://localhost:{port}"]:  # the page's own, as a browser sends
        assert request(server, "POST", "/api/plan", PLAN, {"Origin": origin})[0] == 200, origin


def test_a_post_must_say_its_body_is_json(server):
    for content_type in ["text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/jsonx", None]:
        assert_refused(server, 415, "POST", "/api/plan", {"Content-Type": content_type}, "application/json")
    for content_type in ["application/json; charset=utf-8", "Application/JSON"]:
        assert request(server, "POST", "/api/plan", PLAN, {"Content-Type": content_type})[0] == 200


def handlers_alive() -> int:
    return sum("process_request_thread" in thread.name for thread in threading.enumerate())


def test_a_client_that_hangs_up_leaves_no_traceback(server, capsys):
    body = PLAN.encode()
    head = f"POST /api/plan HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    for reset in (True, True, True, False, False):
        sock = socket.create_connection(server.server_address[:2])
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        if reset:  # close with a reset rather than a FIN: the server's answer meets a closed socket
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    # Connections are accepted in order: once this one is answered, the hung-up ones have their threads.
    assert request(server, "POST", "/api/plan", PLAN)[0] == 200
    deadline = time.monotonic() + 30
    while handlers_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert handlers_alive() == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err


def test_another_error_while_serving_is_one_line_on_stderr(server, capsys):
    for error in (RuntimeError("no\nsuch thing"), ConnectionResetError(104, "reset"), BrokenPipeError(32, "pipe")):
        try:
            raise error
        except (OSError, RuntimeError):
            server.handle_error(None, ("127.0.0.1", 5))
    assert capsys.readouterr().err == "gridtrain explore: serving 127.0.0.1: RuntimeError: no such thing\n"


def test_the_server_keeps_the_interpreter_switching_fast_while_open():
    """Accepting and answering keep pace with two searches: 1 ms switch interval while a server is
    open (the default 5 ms let a burst of 50 connections hold a GET past a second), given back on close."""
    import sys

    before = sys.getswitchinterval()
    srv = make_server()
    try:
        assert sys.getswitchinterval() == min(before, 0.001)
    finally:
        srv.server_close()
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2),
                                     ("zbv", 2), ("dualpipev", 2)])
def test_the_timeline_draws_every_schedule_as_the_planner_times_it(name, v):
    from gridtrain.plan.replay import step_bubble

    t = api.timeline({"pp": 4, "num_microbatches": 8, "pp_virtual_stages": v, "pp_schedule": name})
    for rank in range(4):
        for chunk in range(v):
            mine = [(kind, mb) for r, mb, kind, _, _, c in t["ops"] if r == rank and c == chunk]
            forwards = sorted(mb for kind, mb in mine if kind == "F")
            assert forwards == list(range(8)), (rank, chunk)  # every micro-batch through each chunk once
            # every micro-batch's gradient: a fused backward, or an input pass and a weight pass
            assert sorted(mb for kind, mb in mine if kind in "BI") == forwards
            assert sorted(mb for kind, mb in mine if kind == "W") == sorted(mb for kind, mb in mine if kind == "I")
    assert t["bubble"] == pytest.approx(step_bubble(name, 4, v, 8), rel=1e-9)
    if name in ("gpipe", "1f1b"):
        assert t["bubble"] == pytest.approx(3 / 11)  # (p-1) / (m + p-1)
