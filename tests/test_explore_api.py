"""The explorer's server and JSON API, without a browser: the API answers exactly what
`gridtrain plan --json` prints for the same inputs, junk gets a 4xx with a reason (and the server
keeps serving), the server listens on loopback, and the runs view never leaves its folder."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import random
import shlex
import threading
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
    conn.request(method, path, body=data, headers=headers or {})
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


def test_the_api_answers_what_plan_json_prints_for_20_random_inputs():
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


def test_a_search_that_would_take_minutes_stops_with_the_fix(monkeypatch):
    monkeypatch.setattr(api, "REQUEST_SECONDS", 0.0)
    status, data = api.plan({"model": "llama3-405b", "num_gpus": 8192, "shape": {"vocab_size": 3}})
    assert status == 422 and "ran out of its time" in data["error"] and "fix more of the layout" in data["error"]


def test_a_layout_the_planner_refuses_is_a_422_with_its_reason():
    status, data = api.plan({"model": "llama3-8b", "num_gpus": 8, "layout": {"tp": 3}})
    assert status == 422
    assert "tp=3 cannot split this model" in data["error"] and "choose tp among [1, 2, 4, 8]" in data["error"]


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


def test_the_runs_view_without_a_folder_says_how_to_give_one():
    from gridtrain.explore import runs
    status, data = runs.run_list(None)
    assert status == 200 and data["runs"] == [] and "--runs DIR" in data["note"]
    assert runs.run_page(None, "x")[0] == 404
    assert runs.run_list(Path("/nonexistent-folder"))[0] == 404
