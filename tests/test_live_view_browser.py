"""The live view in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``
packages, driven by Selenium) on a live server while 16 requests run, in a small KV cache
(preemptions) and in the default one (thousands of blocks, most of them free).

Skipped, with the reason, where Selenium or the Debian packages are missing
(``apt-get install -y chromium chromium-driver; pip install selenium``). The screenshot is
saved in the test's temporary directory, and also at ``$PAGEDLLM_LIVE_VIEW_SCREENSHOT`` if set.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_util import Server, start_server, stop_server

API_KEY = "live-key"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WAIT_S = 180  # generous: two shared cores

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip("Debian's chromium and chromium-driver are not installed (apt-get install -y chromium chromium-driver)",
                allow_module_level=True)

from selenium.common.exceptions import StaleElementReferenceException, TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # 24 MiB of bfloat16 K/V is 68 blocks of 16 tokens: 16 requests of up to ~280 tokens do not
    # fit, so some are preempted.
    s = start_server(
        tmp_path_factory.mktemp("live"), "--enable-live-view", "--api-key", API_KEY, "--kv-cache-memory", "24MiB",
        "--max-model-len", "512", "--max-num-batched-tokens", "256", "--disable-log-stats",
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from dataclasses import fields

    from pagedllm.engine.arg_utils import EngineArgs

    default = next(f.default for f in fields(EngineArgs) if f.name == "kv_cache_memory")
    s = start_server(
        tmp_path_factory.mktemp("live-default"), "--enable-live-view", "--api-key", API_KEY,
        "--kv-cache-memory", default, "--max-model-len", "512", "--max-num-batched-tokens", "256", "--disable-log-stats",
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1050"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _send_requests(url: str, n: int, max_tokens: int = 64) -> list[threading.Thread]:
    """``n`` completions at once, half of them behind one shared system prompt (prefix-cache hits)."""
    shared = "You are a careful assistant who answers questions about the history of computing. " * 4

    def one(i: int) -> None:
        prompt = (shared if i % 2 else "") + f"Question {i}: tell me about machine number {i}, in detail. " * (1 + i % 3)
        body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens + 16 * (i % 5),
                "temperature": 0, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    return threads


def _data(driver: webdriver.Chrome, name: str) -> int:
    return int(driver.execute_script(f"return document.body.dataset.{name} || '0'"))


def test_dashboard_needs_the_key(server: Server, browser: webdriver.Chrome) -> None:
    browser.get(f"{server.url}/dashboard")
    assert "missing or invalid API key" in browser.page_source
    assert httpx.get(f"{server.url}/dashboard/events", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/debug/trace", timeout=10).status_code == 401


def test_dashboard_shows_blocks_steps_and_requests_under_load(
    server: Server, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    browser.get_log("browser")  # drops the earlier pages' entries
    browser.get(f"{server.url}/dashboard?api_key={API_KEY}")
    wait = WebDriverWait(browser, WAIT_S, poll_frequency=0.2)
    wait.until(lambda d: _data(d, "frames") >= 2)  # the event stream is live
    threads = _send_requests(server.url, 16)
    wait.until(lambda d: _data(d, "heldBlocks") > 0 and _data(d, "steps") > 0)
    wait.until(lambda d: _data(d, "requests") >= 16)
    steps_before = _data(browser, "steps")
    wait.until(lambda d: _data(d, "steps") > steps_before)  # the timeline gains bars
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".row[data-finished='length'], .row[data-finished='stop']"))
    try:  # a preemption makes the screenshot tell more; not asserted: it depends on timing
        WebDriverWait(browser, 20, poll_frequency=0.2).until(lambda d: _data(d, "preemptions") > 0)
    except TimeoutException:
        pass
    frames = _data(browser, "frames")  # a few more frames: the page under load, some requests finished
    wait.until(lambda d: _data(d, "frames") >= frames + 3)
    shot = tmp_path / "live_view.png"
    browser.save_screenshot(str(shot))
    if os.environ.get("PAGEDLLM_LIVE_VIEW_SCREENSHOT"):
        shutil.copy(shot, os.environ["PAGEDLLM_LIVE_VIEW_SCREENSHOT"])
    # The waterfall is redrawn with every frame: a row found may be gone by the click, so look
    # it up and click it again until one click lands between two frames.
    wait.until(lambda d: _click_finished_row(d))  # selects it: its row is marked, the map dims the others
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".row.selected"))
    # No script error on any frame (network entries: the browser's own favicon request, refused without the key).
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"] == []
    for t in threads:
        t.join(WAIT_S)
    trace = httpx.get(f"{server.url}/debug/trace", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    request_tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["pid"] == 2
                      and e["name"] == "thread_name"}
    assert len(request_tracks) >= 16


def _click_finished_row(driver: webdriver.Chrome) -> bool:
    """Click a finished request's row (it shows its TTFT); False where a redraw replaced it first."""
    try:
        row = driver.find_elements(By.CSS_SELECTOR, ".row[data-finished='length'], .row[data-finished='stop']")[0]
        assert "TTFT" in row.text
        row.click()
    except StaleElementReferenceException:
        return False
    return True


# Where the page draws its rows and its first held block, read in one script (between two frames).
_LAYOUT = """
const rows = [...document.querySelectorAll('#waterfall .row')].map((r) =>
  [r.dataset.finished, r.getBoundingClientRect().bottom]);
const canvas = document.getElementById('map'), ratio = window.devicePixelRatio || 1;
const at = document.body.dataset.heldCellAt, size = Number(document.body.dataset.heldCell || 0);
let measured = 0;
if (at) {  // the run of the held cell's own colour through its middle, in CSS pixels
  const [x, y] = at.split(',').map(Number), box = canvas.getBoundingClientRect();
  const line = canvas.getContext('2d').getImageData(0, Math.round((y + size / 2) * ratio), canvas.width, 1).data;
  const mid = Math.round((x + size / 2) * ratio);
  const same = (i) => [0, 1, 2, 3].every((k) => Math.abs(line[4 * i + k] - line[4 * mid + k]) < 8);
  let a = mid, b = mid;
  while (a > 0 && same(a - 1)) a--;
  while (b < canvas.width - 1 && same(b + 1)) b++;
  measured = (b - a + 1) / ratio;
}
return {rows, screen: window.innerHeight, size, measured};
"""


def test_default_cache_shows_running_requests_first_and_held_blocks_at_a_visible_size(
    default_server: Server, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    """At the default cache size (thousands of blocks, a few dozen in use), the block map zooms to
    the blocks in use and the waterfall lists running requests on the first screen, above the
    requests that finished before them."""
    browser.get(f"{default_server.url}/dashboard?api_key={API_KEY}")
    wait = WebDriverWait(browser, WAIT_S, poll_frequency=0.2)
    wait.until(lambda d: _data(d, "frames") >= 2)
    for t in _send_requests(default_server.url, 24, max_tokens=4):  # finished rows, older than the next ones
        t.join(WAIT_S)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".row[data-finished='length']")) >= 24)
    threads = _send_requests(default_server.url, 16, max_tokens=96)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".row[data-finished='']")) >= 12 and _data(d, "heldBlocks") > 0)
    layout = browser.execute_script(_LAYOUT)
    shot = tmp_path / "live_view_default.png"
    browser.save_screenshot(str(shot))
    if os.environ.get("PAGEDLLM_LIVE_VIEW_SCREENSHOT"):
        shutil.copy(shot, Path(os.environ["PAGEDLLM_LIVE_VIEW_SCREENSHOT"]).with_suffix(".default.png"))
    kinds = [finished for finished, _ in layout["rows"]]
    unfinished = [bottom for finished, bottom in layout["rows"] if not finished]
    assert len(unfinished) >= 12 and "length" in kinds
    assert kinds == sorted(kinds, key=bool), "unfinished rows come before finished ones"
    assert max(unfinished) <= layout["screen"], "every running or waiting request is on the first screen"
    assert layout["size"] >= 8 and layout["measured"] >= 8, layout
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"] == []
    for t in threads:
        t.join(WAIT_S)
