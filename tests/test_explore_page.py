"""The explorer's page in a real headless browser (the system's Chromium, driven by Playwright):
the lecture's presets and their verdicts, the memory bars against `gridtrain plan --json`, the
ranked layouts, the URL as the whole state, every calculation card at its worked problem's
inputs, and a run's page. Screenshots go to docs/explorer/ (linked from the README)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gridtrain.explore import api
from gridtrain.explore.server import make_server
from test_explore_api import cli_plan_json
from test_plan_lessons import CARDS

playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[test]')")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (apt-get install chromium)")
SHOTS = Path(__file__).resolve().parents[1] / "docs" / "explorer"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic"]


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("explore-runs")


@pytest.fixture(scope="module")
def fsdp_run(runs_root: Path, corpus_dir: Path) -> Path:
    """A finished run of FSDP over 2 processes that wrote its accounting (memory and collectives)."""
    from conftest import tiny_overrides

    items = tiny_overrides(runs_root, corpus_dir) | {"run_dir": str(runs_root / "fsdp2"), "train.steps": 12,
                                                     "train.val_every": 4, "metrics.account_every": 4,
                                                     "metrics.log_every": 1, "parallel.zero_stage": 3}
    flags = [arg for key, value in items.items() for arg in (f"--{key}", str(value).lower())]
    proc = subprocess.run([sys.executable, "-m", "gridtrain", "train", "--nproc", "2", *flags],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return runs_root / "fsdp2"


@pytest.fixture(scope="module")
def explore_server(runs_root: Path):
    # The page's answers are compared with `gridtrain plan`'s, which has no time budget: a busy machine
    # must not cut a search short here (test_explore_api.py tests the budget's partial answers).
    budget = api.SEARCH_SECONDS
    api.SEARCH_SECONDS = 60.0
    server = make_server(runs_dir=runs_root)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()
    api.SEARCH_SECONDS = budget


@pytest.fixture(scope="module")
def base_url(explore_server) -> str:
    return f"http://127.0.0.1:{explore_server.server_address[1]}/"


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, base_url):
    context = browser.new_context(viewport={"width": 1150, "height": 1300})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(base_url)
    pg.wait_for_selector("body[data-ready='1']")
    yield pg
    context.close()
    assert errors == [], errors


def settle(page) -> None:
    """Wait until the page has drawn the answer to its latest change."""
    page.wait_for_selector("body[data-pending='0']", state="attached")


def preset(page, name: str) -> str:
    page.click(f"[data-preset='{name}']")
    settle(page)
    return page.inner_text("#verdict")


def bars(page) -> dict[tuple[int, str], float]:
    rects = page.eval_on_selector_all("#memory rect[data-bucket]",
                                      "rs => rs.map(r => [r.dataset.rank, r.dataset.bucket, r.dataset.gib])")
    return {(int(rank), bucket): float(gib) for rank, bucket, gib in rects}


def test_7b_pure_dp_does_not_fit_and_zero3_fits_with_the_plans_bars(page):
    assert preset(page, "7b-8gpu").startswith("does not fit")
    assert "no layout with tp=1,cp=1,pp=1,zero=0" in page.inner_text("#reason")
    page.screenshot(path=str(SHOTS / "preset-7b-8gpu.png"), full_page=True)
    page.select_option("#in-zero", "3")
    page.wait_for_function("() => document.getElementById('verdict').textContent.startsWith('fits')")
    settle(page)
    command = page.inner_text("#command")
    assert "zero=3" in command and "dp_shard=8" in command
    code, plan, _ = cli_plan_json(command)
    assert code == 0 and plan["fits"]
    expected = {(r["rank"], b): v for r in plan["memory"]["pipeline_ranks"] for b, v in r["buckets_GiB"].items()}
    assert bars(page) == pytest.approx(expected, rel=1e-12)
    assert len(expected) == 5  # one pipeline rank: first, last and peak at once


def test_405b_on_128_gpus_fits_with_tp_pp_fsdp(page):
    verdict = preset(page, "405b-128gpu")
    assert verdict.startswith("fits") and "tp 8, pp 4" in verdict and "ZeRO 3" in verdict
    assert page.eval_on_selector_all("#timeline rect[data-kind]", "rs => rs.length") > 0
    ranks = {rank for rank, _ in bars(page)}
    assert ranks == {0, 3}  # the first pipeline rank (the peak) and the last
    page.screenshot(path=str(SHOTS / "preset-405b-128gpu.png"), full_page=True)
    # 64 micro-batches (256 sequences over dp 4): each forward still at least 14 px wide, the chart scrolls.
    page.fill("#in-global_batch", "256")
    page.wait_for_function("() => JSON.parse(document.getElementById('verdict').dataset.request || '{}')"
                           ".global_batch === 256")
    settle(page)
    assert "mb 1 x 64" in page.inner_text("#verdict")
    widths = page.eval_on_selector_all("#timeline rect[data-kind='F']", "rs => rs.map(r => r.width.baseVal.value)")
    assert len(widths) == 4 * 64 and min(widths) >= 13


def test_405b_on_8_gpus_fits_no_layout_and_says_why(page):
    assert preset(page, "405b-8gpu").startswith("does not fit")
    code, _, err = cli_plan_json(page.inner_text("#command"))
    reason = page.inner_text("#reason")
    assert code == 2 and reason.startswith("no layout of this model fits on 8 x H100-SXM")
    assert reason.strip() in err  # the planner's own words
    page.screenshot(path=str(SHOTS / "preset-405b-8gpu.png"), full_page=True)


def test_a_layout_that_does_not_fit_shows_its_best_fix_first_and_no_mfu(page):
    assert preset(page, "70b-256gpu").startswith("does not fit")
    first = page.inner_text("#fix-table tbody tr:nth-child(1) th")
    assert first.startswith("zero 0 -> 3") and "FSDP" in first
    assert "pp 1 -> 32" in page.inner_text("#fix-table tbody tr:nth-child(2) th")
    assert "best fix: zero 0 -> 3" in page.inner_text("#verdict")
    metrics = page.eval_on_selector_all("#metrics tr", "trs => trs.map(tr => tr.dataset.metric)")
    assert "MFU" not in metrics and "step time" not in metrics and "tokens/s" not in metrics
    assert page.eval_on_selector_all("#steptime rect", "rs => rs.length") == 0
    page.screenshot(path=str(SHOTS / "no-fit-70b-256gpu.png"), full_page=True)
    page.click("#fix-table tbody tr:nth-child(1)")
    settle(page)
    assert page.inner_text("#verdict").startswith("fits") and page.input_value("#in-zero") == "3"
    assert page.is_hidden("#fixes") and "MFU" in page.inner_text("#metrics")
    # Llama 2 7B on 8 GPUs: the lecture's fix, FSDP over the 8 ranks, leads.
    preset(page, "7b-8gpu")
    assert "FSDP" in page.inner_text("#fix-table tbody tr:nth-child(1) th")


def test_the_landing_page_and_a_ranked_list_that_explains_itself(page):
    page.screenshot(path=str(SHOTS / "landing.png"), full_page=True)
    preset(page, "405b-128gpu")
    page.click("#search")
    page.wait_for_selector("#best tbody tr")
    why = page.inner_text("#why-first")
    assert why.startswith("#1 ") and "#2" in why  # the planner's why_first, word for word
    code, plan, _ = cli_plan_json(page.inner_text("#search-note").split("(")[1].split(")")[0])
    assert code == 0 and why == " ".join(plan["why_first"])
    differs = page.eval_on_selector_all("#best tbody td.differs", "tds => tds.map(td => td.textContent)")
    assert differs[0] == "" and all(" -> " in d for d in differs[1:])
    page.locator("#best").scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "ranked-405b-128gpu.png"), full_page=True)


def test_a_ranked_layout_applies_on_click_and_the_url_keeps_the_state(page, browser):
    preset(page, "7b-8gpu")
    page.click("#search")
    page.wait_for_selector("#best tbody tr")
    code, plan, _ = cli_plan_json(page.inner_text("#search-note").split("(")[1].split(")")[0])
    assert code == 0
    second = plan["ranked"][1]["layout"]
    page.click("#best tbody tr:nth-child(2)")
    settle(page)
    chosen = {k: page.input_value(f"#in-{k}") for k in ("tp", "pp", "cp", "zero", "mb", "recompute")}
    assert chosen == {"tp": str(second["tp"]), "pp": str(second["pp"]), "cp": str(second["cp"]),
                      "zero": str(second["zero_stage"]), "mb": str(second["micro_batch"]),
                      "recompute": second["recompute"]}
    verdict, command = page.inner_text("#verdict"), page.inner_text("#command")
    fresh = browser.new_page()
    fresh.goto(page.url)
    fresh.wait_for_selector("body[data-ready='1']")
    settle(fresh)
    assert fresh.inner_text("#verdict") == verdict and fresh.inner_text("#command") == command
    assert {k: fresh.input_value(f"#in-{k}") for k in chosen} == chosen
    fresh.close()


def test_an_invalid_choice_shows_the_planners_reason(page):
    page.select_option("#in-tp", "16")
    page.wait_for_function("() => document.getElementById('verdict').textContent.startsWith('invalid')")
    assert "tp=16 cannot split this model" in page.inner_text("#reason")


def test_the_ep_input_is_live_for_a_mixture_of_experts(page):
    """A dense model leaves ep at 1 (disabled); Mixtral offers its experts' divisors, and ep 8 is
    planned: the command carries it and the step shows the all-to-alls."""
    assert page.is_disabled("#in-ep")
    page.select_option("#in-model", "mixtral-8x7b")
    page.fill("#in-num_gpus", "64")
    settle(page)
    assert not page.is_disabled("#in-ep")
    assert page.eval_on_selector_all("#in-ep option", "os => os.map(o => o.value)") == ["", "2", "4", "8"]
    assert "12.9B active (8 experts)" in page.inner_text("#model-params")
    page.select_option("#in-ep", "8")
    page.wait_for_function("() => document.getElementById('command').textContent.includes('ep=8')")
    settle(page)
    assert "EP all-to-alls" in page.inner_text("#outputs")
    page.select_option("#in-model", "llama3-8b")
    settle(page)
    assert page.is_disabled("#in-ep") and "ep=" not in page.inner_text("#command")


RECORD_VERDICTS = """() => {
  window.verdicts = [];
  const v = document.getElementById('verdict');
  new MutationObserver(() => window.verdicts.push([v.className, v.dataset.request || '{}', v.textContent]))
    .observe(v, {childList: true, characterData: true, subtree: true, attributes: true});
}"""


def test_typing_8192_ends_on_the_plan_for_8192_and_never_shows_a_valid_value_invalid(page, explore_server):
    # 70B on 256 H100s. Each key comes after the page's debounce, so 8, 81 and 819 are all asked:
    # 81 and 819 search for seconds, and each is dropped (client and server) when the next key comes.
    page.goto(page.url.split("?")[0] + "?model=llama3-70b&gpu=h100&num_gpus=256&seq_len=4096&global_batch=512")
    page.wait_for_selector("body[data-ready='1']")
    settle(page)
    page.evaluate(RECORD_VERDICTS)
    cancelled = explore_server.cancelled
    page.fill("#in-seq_len", "")
    page.type("#in-seq_len", "8192", delay=450)
    page.wait_for_function("() => JSON.parse(document.getElementById('verdict').dataset.request).seq_len === 8192")
    settle(page)
    assert page.inner_text("#verdict").startswith("fits") and "partial" not in page.inner_text("#verdict")
    code, plan, _ = cli_plan_json(page.inner_text("#command"))
    assert code == 0 and "--seq-len 8192" in page.inner_text("#command")
    expected = {(r["rank"], b): v for r in plan["memory"]["pipeline_ranks"] for b, v in r["buckets_GiB"].items()}
    assert bars(page) == pytest.approx(expected, rel=1e-12)
    shown = [(cls, json.loads(request).get("seq_len"), text) for cls, request, text in page.evaluate("window.verdicts")]
    assert [seq for cls, seq, _ in shown if "invalid" in cls or "unknown" in cls] in ([], [8]), shown  # 8 < 16: truly invalid
    assert explore_server.cancelled > cancelled  # a superseded search stopped on the server


LLAMA2_7B_PARAMS = 6_738_415_616
"""Llama 2 7B's parameters as published with its weights (Touvron et al. 2023; the Hub's model card)."""
LLAMA2_7B_TENSORS = 32 * 9 + 3
"""Per layer wq, wk, wv, wo, w1, w2, w3 and two norms; the embedding, the final norm, the output."""
LLAMA3_405B_PARAMS = 405_853_388_800


def state_gb(page) -> float:
    return float(page.get_attribute("#state-line", "data-gb"))


def test_the_bytes_per_parameter_switch_gives_the_notes_and_the_runtimes_bytes(page):
    page.goto(page.url.split("?")[0] + "?model=llama3-8b&n_kv_heads=32&ffn_dim=11008&vocab_size=32000&num_gpus=8"
              "&seq_len=4096&global_batch=512&tp=1&pp=1&cp=1&zero=0&mb=1&recompute=none")
    page.wait_for_selector("body[data-ready='1']")
    settle(page)
    # gridtrain's runtime: fp32 weights, gradients, two moments (16 bytes) and a 4-byte step per tensor.
    assert state_gb(page) * 1e9 == pytest.approx(LLAMA2_7B_PARAMS * 16 + LLAMA2_7B_TENSORS * 4, rel=1e-12)
    page.select_option("#in-convention", "no-master")
    page.wait_for_function("() => document.getElementById('state-line').textContent.includes('lecture notes')")
    settle(page)
    assert state_gb(page) == pytest.approx(LLAMA2_7B_PARAMS * 12 / 1e9, rel=1e-12)  # 80.9 GB: 6.74B x 12
    assert "--convention no-master" in page.inner_text("#command")
    assert "no fp32 master copy" in page.inner_text("#convention-note")
    page.goto(page.url.split("?")[0] + "?model=llama3-405b&num_gpus=1024&seq_len=8192&global_batch=1024"
              "&tp=1&pp=1&cp=1&zero=3&convention=no-master")
    page.wait_for_selector("body[data-ready='1']")
    settle(page)
    assert state_gb(page) == pytest.approx(LLAMA3_405B_PARAMS * 12 / 1024 / 1e9, rel=1e-12)  # 4.76 GB
    # The ZeRO card at the notes' 12 bytes: 7B x 12 = 84 GB; 405B over 1,024 with ZeRO-3 405 x 12 / 1,024 = 4.75 GB.
    page.goto(page.url.split("?")[0] + "#cards")
    page.wait_for_selector("#card-zero-memory tr[data-answer]")
    page.select_option("#cards-convention", "no-master")
    page.wait_for_function("() => document.querySelector('#card-zero-memory tr[data-answer=\"no ZeRO\"] .value')"
                           "?.dataset.value === '84'")
    page.fill("#card-zero-memory input[name='P']", "405")
    page.fill("#card-zero-memory input[name='N']", "1024")
    page.wait_for_function("() => document.querySelector('#card-zero-memory tr[data-answer=\"ZeRO-3\"] .value')"
                           "?.textContent === '4.746'")
    assert card_answers(page, "zero-memory")["ZeRO-3"] == pytest.approx(405 * 12 / 1024)


def card_answers(page, card_id: str) -> dict[str, float]:
    rows = page.eval_on_selector_all(f"#card-{card_id} tr[data-answer]",
                                     "rs => rs.map(r => [r.dataset.answer, r.querySelector('.value').dataset.value])")
    return {label: float(value) for label, value in rows}


def test_every_card_shows_the_worked_answers_and_answers_new_inputs(page):
    page.goto(page.url.split("#")[0] + "#cards")
    page.wait_for_selector("#card-ring tr[data-answer]")
    shown = {card: card_answers(page, card) for card in CARDS}
    for card, expected in CARDS.items():
        assert {k: shown[card][k] for k in expected} == pytest.approx(expected, rel=1e-9), card
    page.screenshot(path=str(SHOTS / "cards.png"))
    all_ids = page.eval_on_selector_all(".card", "cs => cs.map(c => c.id.slice(5))")
    assert page.eval_on_selector_all("#card-roofline polyline[data-roof='accelerator']", "ps => ps.length") == 1
    index = page.eval_on_selector_all("#card-index a", "as => as.map(a => a.dataset.card)")
    assert sorted(index) == sorted(all_ids)
    assert sorted(all_ids) == sorted(CARDS)  # no card left untested
    # The usually quoted answers that are wrong carry the reason on the card.
    assert "round (N-1)/N to 1" in page.inner_text("#card-zero3-traffic .correction")
    assert "one phase" in page.inner_text("#card-tp .correction")
    # Typing recomputes: 16 GPUs -> 2 x 2 GB x 15/16 = 3.75 GB per GPU.
    page.fill("#card-ring input[name='N']", "16")
    page.wait_for_function("() => document.querySelector('#card-ring tr[data-answer=\"steps\"] .value')?.dataset.value === '30'")
    assert card_answers(page, "ring")["bytes each GPU sends"] == pytest.approx(3.75)
    # A card's link opens its explorer state.
    page.click("#card-zero-memory a.to-explorer")
    page.wait_for_selector("#view-explore:not([hidden])")
    settle(page)
    assert page.input_value("#in-num_gpus") == "64" and page.input_value("#in-zero") == "3"


@pytest.mark.dist
def test_a_runs_page_draws_its_curves_and_the_check(page, fsdp_run):
    page.goto(page.url.split("#")[0] + "#runs")
    page.wait_for_selector("#runs a")
    assert page.inner_text("#runs a") == fsdp_run.name
    page.click("#runs a")
    page.wait_for_selector("#check tr[data-key]")
    points = page.eval_on_selector_all("#run-loss polyline", "ps => ps.map(p => p.getAttribute('points').split(' ').length)")
    assert len(points) == 2 and points[1] == 4  # train loss, and validation at steps 0, 4, 8 and 12
    assert page.eval_on_selector_all("#run-tps polyline", "ps => ps.length") == 1
    rows = page.eval_on_selector_all("#check tr[data-key]", "trs => trs.map(tr => [tr.dataset.rank, tr.dataset.key, "
                                     "[...tr.querySelectorAll('td')].map(td => td.textContent)])")
    keys = {(int(rank), key) for rank, key, _ in rows}
    assert {(r, b) for r in (0, 1) for b in ("weights", "gradients", "optimizer", "activations")} <= keys
    assert any(key.startswith("dp_shard/") for _, key in keys)  # FSDP's collectives, by axis
    weights = next(cells for rank, key, cells in rows if key == "weights")
    assert weights[1] == weights[2] and weights[3] == "1"  # predicted = measured, ratio 1
    page.screenshot(path=str(SHOTS / "run-page.png"), full_page=True)
    assert "bytes (" in weights[1] and "census.py" in weights[4]  # units, and what the row counts
    page.click("#run-layout a.to-explorer")  # the plan of the run's layout
    page.wait_for_selector("#view-explore:not([hidden])")
    settle(page)
    assert page.input_value("#in-num_gpus") == "2" and page.input_value("#in-zero") == "3"
    assert page.inner_text("#verdict").startswith("fits")
