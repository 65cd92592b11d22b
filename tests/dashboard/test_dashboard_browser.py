"""The dashboard in a real browser: headless Chromium (Selenium) against `build_dashboard_app` served by
uvicorn; the numbers on the page must equal the recording's (the per-expert imbalance and the uniform share
too), times must be the reader's wall-clock time, the page must follow the file as it grows and say "stopped"
once the recording ends, and one EP rank must not get a chart of ranks.

Skipped when Chromium / chromedriver / selenium are missing, unless MOE_REQUIRE_BROWSER is set (CI sets it:
there a missing browser fails). A screenshot goes to $MOE_TEST_ARTIFACTS or tests/dashboard/artifacts/.
"""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
import uvicorn

from moe.dashboard import build_dashboard_app
from moe.expert_load.recording import RecordingWriter
from tests.dashboard.synthetic import LAYERS, NUM_EXPERTS, hottest, imbalance, make_meta, make_window

ARTIFACTS = os.environ.get("MOE_TEST_ARTIFACTS") or os.path.join(os.path.dirname(__file__), "artifacts")
WAIT_S = 20
# The browser runs in this zone (no summer time), so that a time axis in UTC, or in the test machine's zone,
# would not match.
BROWSER_TZ = "Asia/Kolkata"
BROWSER_OFFSET = timezone(timedelta(hours=5, minutes=30))


def _missing(reason: str):
    if os.environ.get("MOE_REQUIRE_BROWSER"):
        pytest.fail(f"MOE_REQUIRE_BROWSER is set but {reason}")
    pytest.skip(reason)


def _browser_paths() -> tuple[str, str]:
    binary = next((p for p in map(shutil.which, ["chromium", "chromium-browser", "google-chrome"]) if p), None)
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver")
                                              else None)
    if binary is None or driver is None:
        _missing(f"no Chromium ({binary}) or chromedriver ({driver}) on PATH")
    return binary, driver


@pytest.fixture
def browser():
    binary, driver_path = _browser_paths()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("selenium is not installed (pip install -e '.[test]')")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
                "--disable-dev-shm-usage", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "SEVERE"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    # --window-size counts the window's frame: make the page itself 1280 x 900, as a user's screen would show it.
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False})
    driver.execute_cdp_cmd("Emulation.setTimezoneOverride", {"timezoneId": BROWSER_TZ})
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()


@pytest.fixture
def serve():
    """serve(app) -> base URL; uvicorn runs in a thread on a loopback socket bound to a free port."""
    servers = []

    def start(app) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread, sock))
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start within 10 s"
            time.sleep(0.02)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, thread, sock in servers:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _wait_for(driver, script: str, expected, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(lambda d: d.execute_script(script) == expected)
    except Exception:
        status = driver.execute_script("return document.getElementById('status').textContent")
        raise AssertionError(f"{what}: {script!r} is {driver.execute_script(script)!r} after {WAIT_S} s, "
                             f"expected {expected!r} (page status: {status!r})") from None


def _local_time(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, BROWSER_OFFSET).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _traces(driver) -> dict[str, list[dict]]:
    """The over-time plot's traces by name: [{x, y, yaxis}] (a layer's name has one per subplot)."""
    got = driver.execute_script("return document.getElementById('over-time').data.map((t) => "
                                "({name: t.name, x: t.x, y: t.y, yaxis: t.yaxis}))")
    out: dict[str, list[dict]] = {}
    for t in got:
        out.setdefault(t["name"], []).append(t)
    return out


def _check_page_matches(driver, windows, rebalances: int) -> None:
    from selenium.webdriver.common.by import By

    single_rank = windows[0].per_rank.shape[1] == 1
    counts_LE = np.sum([w.counts for w in windows], axis=0)
    per_rank_LP = np.sum([w.per_rank for w in windows], axis=0)
    mean_balancedness = float(np.mean([w.balancedness.mean() for w in windows]))
    imbalance_WL = np.array([imbalance(w.counts) for w in windows])
    value = lambda id_: driver.find_element(By.ID, id_).get_attribute("data-value")  # noqa: E731
    text = lambda id_: driver.find_element(By.ID, id_).text  # noqa: E731

    total = int(counts_LE.sum())
    assert int(value("total-tokens")) == total and text("total-tokens") == f"{total:,}"
    assert int(value("windows-received")) == len(windows) and text("windows-received") == str(len(windows))
    steps = sum(w.step_end - w.step_start for w in windows)
    assert int(value("steps-covered")) == steps
    assert float(value("mean-imbalance")) == pytest.approx(imbalance_WL.mean(), rel=1e-12)
    assert text("mean-imbalance") == f"{imbalance_WL.mean():.2f}"
    assert float(value("mean-balancedness")) == pytest.approx(mean_balancedness, rel=1e-12)
    assert text("mean-balancedness") == ("always 1" if single_rank else f"{mean_balancedness:.3f}")
    assert int(value("rebalances")) == rebalances

    state = driver.execute_script("const s = window.dashboardState; return [s.counts, s.perRank, s.lastCounts];")
    assert state[0] == counts_LE.tolist()
    assert state[1] == per_rank_LP.tolist()
    assert state[2] == windows[-1].counts.tolist()

    # The hottest experts, each against the uniform share (1 / E of its layer's tokens).
    assert text("uniform-share") == f"{100 / NUM_EXPERTS:.3g} %"
    rows = driver.find_elements(By.CSS_SELECTOR, "#hot-experts tbody tr")
    got = [(int(r.get_attribute("data-row")), int(r.get_attribute("data-layer")), int(r.get_attribute("data-expert")),
            int(r.get_attribute("data-count")), float(r.get_attribute("data-share")),
            float(r.get_attribute("data-vs-uniform"))) for r in rows]
    want = hottest(counts_LE, 10)
    assert len(got) == 10
    for (row, layer, expert, count, share, vs_uniform), (w_row, w_expert, w_count, w_share) in zip(got, want):
        assert (row, layer, expert, count) == (w_row, LAYERS[w_row], w_expert, w_count)
        assert share == pytest.approx(w_share, rel=1e-12)
        assert vs_uniform == pytest.approx(w_share * NUM_EXPERTS, rel=1e-12)
    first_cells = [td.text for td in rows[0].find_elements(By.TAG_NAME, "td")]
    assert first_cells[1:4] == [str(LAYERS[want[0][0]]), str(want[0][1]), f"{want[0][2]:,}"]
    assert first_cells[4] == f"{100 * want[0][3]:.1f} %"
    assert first_cells[5] == f"{want[0][3] * NUM_EXPERTS:.2f}×"
    # The gauges share the largest share's scale; the uniform tick sits at 1 / E on it, left of every fill.
    scale = max(w[3] for w in want)
    ticks = driver.execute_script("return [...document.querySelectorAll('#hot-experts .gauge')].map((g) => "
                                  "[g.querySelector('.fill').style.width, g.querySelector('.uniform').style.left])")
    percent = lambda css: float(css.removesuffix("%"))  # noqa: E731
    assert [percent(t[1]) for t in ticks] == pytest.approx([100 / NUM_EXPERTS / scale] * 10, abs=0.051)
    assert [percent(t[0]) for t in ticks] == pytest.approx([100 * w[3] / scale for w in want], abs=0.051)

    # The plots drew from the same numbers (the page hands plotly copies, so stale plots would differ).
    assert driver.execute_script("return document.getElementById('heatmap').data[0].z") == counts_LE.tolist()
    traces = _traces(driver)
    times = [_local_time(w.time) for w in windows]
    (imb,) = traces["expert imbalance"]
    assert imb["x"] == times
    np.testing.assert_allclose(imb["y"], imbalance_WL.mean(axis=1), rtol=1e-12)
    for l, label in enumerate(f"layer {x}" for x in LAYERS):
        np.testing.assert_allclose(traces[label][0]["y"], imbalance_WL[:, l], rtol=1e-12)
        assert traces[label][0]["x"] == times
    if single_rank:
        assert "rank balancedness" not in traces and all(len(traces[f"layer {x}"]) == 1 for x in LAYERS)
    else:
        (bal,) = traces["rank balancedness"]
        assert bal["x"] == times and bal["yaxis"] == "y2"
        np.testing.assert_allclose(bal["y"], [w.balancedness.mean() for w in windows], rtol=1e-12)
        bars = driver.execute_script("return document.getElementById('rank-bars').data.map((t) => t.y)")
        assert bars == per_rank_LP.T.tolist()
    # plotly drew them: one marker per window on the imbalance line, on a date axis labelled with clock times.
    markers = driver.execute_script("return document.querySelectorAll('#over-time .scatterlayer .trace')[0]"
                                    ".querySelectorAll('.points path').length")
    assert markers == len(windows)
    axis = "xaxis" if single_rank else "xaxis2"
    assert driver.execute_script(f"return document.getElementById('over-time')._fullLayout.{axis}.type") == "date"
    x_range = driver.execute_script(f"return document.getElementById('over-time')._fullLayout.{axis}.range")
    assert x_range[0] <= times[0] and times[-1] <= x_range[1]
    tick_class = "xtick" if single_rank else "x2tick"
    labels = driver.execute_script(f"return [...document.querySelectorAll('#over-time .{tick_class} text')]"
                                   ".map((t) => t.textContent)")
    assert labels and all(":" in t for t in labels), labels


def _wait_for_page(browser, base: str, windows: int) -> None:
    browser.get(f"{base}/dashboard/?poll_ms=200")
    _wait_for(browser, "return window.dashboardState && window.dashboardState.windowsReceived", windows,
              "first load")
    _wait_for(browser, "return document.querySelectorAll('#heatmap .main-svg, #over-time .main-svg').length >= 2",
              True, "plots rendered")


def _screenshot(browser, name: str) -> None:
    os.makedirs(ARTIFACTS, exist_ok=True)
    shot = os.path.join(ARTIFACTS, name)
    assert browser.save_screenshot(shot)
    print(f"dashboard screenshot: {shot}")
    errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    assert errors == [], f"browser console errors: {errors}"


def _status(browser) -> tuple[str, str]:
    return browser.execute_script("const s = document.getElementById('status'); return [s.dataset.state, "
                                  "s.textContent];")


def test_dashboard_shows_the_recording_and_follows_it_live(tmp_path, browser, serve):
    from selenium.webdriver.common.by import By

    path = tmp_path / "load.jsonl"
    rng = np.random.default_rng(7)
    windows = [make_window(i, rng) for i in range(5)]
    writer = RecordingWriter(path, make_meta())
    for w in windows[:3]:
        writer.write_window(w)
    writer.write_placement(2, np.tile(np.roll(np.arange(16), 1), (len(LAYERS), 1)))
    for w in windows[3:]:
        writer.write_window(w)

    base = serve(build_dashboard_app(str(path)))
    _wait_for_page(browser, base, 5)
    assert "synthetic/skewed-moe" in browser.find_element(By.ID, "title").text
    state, status = _status(browser)
    assert state == "live" and status.startswith("live · last window ")
    assert browser.find_element(By.ID, "rank-panel").is_displayed()
    _check_page_matches(browser, windows, rebalances=1)

    # The "last window" toggle redraws the heatmap from the newest window alone, and back.
    browser.find_element(By.ID, "mode-last").click()
    assert browser.execute_script("return document.getElementById('heatmap').data[0].z") == windows[-1].counts.tolist()
    browser.find_element(By.ID, "mode-cumulative").click()

    # The recording grows: the page follows without a reload; it is still live.
    more = [make_window(i, rng) for i in (5, 6)]
    for w in more:
        writer.write_window(w)
    _wait_for(browser, "return window.dashboardState.windowsReceived", 7, "live update")
    _check_page_matches(browser, windows + more, rebalances=1)
    assert _status(browser)[0] == "live"
    assert browser.execute_script("return document.getElementById('rank-bars').data.length") == 2  # one per rank

    # stop_expert_load_recording closes the writer: its end line turns the page to "stopped".
    writer.close()
    _wait_for(browser, "return document.getElementById('status').dataset.state", "stopped", "recording ended")
    state, status = _status(browser)
    assert status.startswith("stopped at ") and status.endswith(" · recording ended"), status
    _screenshot(browser, "dashboard.png")


def test_one_ep_rank_shows_no_rank_chart_and_says_why(tmp_path, browser, serve):
    from selenium.webdriver.common.by import By

    path = tmp_path / "load.jsonl"
    rng = np.random.default_rng(3)
    windows = [make_window(i, rng, ep_size=1) for i in range(6)]
    with RecordingWriter(path, make_meta(ep_size=1)) as writer:
        for w in windows:
            writer.write_window(w)

    base = serve(build_dashboard_app(str(path)))
    _wait_for_page(browser, base, 6)
    _check_page_matches(browser, windows, rebalances=0)
    # No chart that says nothing: the rank panel is gone, the chart over time takes its row, and the page
    # says why balancedness is not shown.
    assert not browser.find_element(By.ID, "rank-panel").is_displayed()
    assert browser.execute_script("return document.getElementById('rank-bars').data") is None
    assert "one EP rank" in browser.find_element(By.ID, "time-note").text
    assert browser.find_element(By.ID, "balancedness-hint").text == "(one EP rank)"
    width = lambda css: browser.execute_script(f"return document.querySelector('{css}')"  # noqa: E731
                                               ".getBoundingClientRect().width")
    assert width("#time-panel") == pytest.approx(width(".heatmap-panel") + width(".table-panel") + 12, abs=2)
    assert _status(browser)[0] == "stopped"  # the writer was closed
    _screenshot(browser, "dashboard-one-rank.png")
