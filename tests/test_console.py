"""``ccsq console`` in a real browser (headless Chromium through chromedriver) against a
real swarm (tests/swarm.py): every page renders, the numbers match ``ccsq gap-report
--json``, a dead letter replayed from the page (with its confirmation) ends
acknowledged, the broker stopped leaves the pages on the ledger; the static
``gap-report --html`` legend is not clipped. Without a browser the safety rules
(loopback, tokens, CSRF, roles) are checked over real HTTP.

``CCSQ_CONSOLE_SCREENSHOTS=DIR`` also saves a PNG of each page there (that is how
docs/console/*.png are made). Chromium comes from Debian (``chromium``,
``chromium-driver``; .ci/run installs them): under CI a missing browser fails
the test, elsewhere it skips.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from ccsq.tools import admin_client
from ccsq.common.wire.config import AdminConfig, load
from ccsq.common.wire.errors import ConfigError, ExitCode
from ccsq.tools.procs import bin_path, free_tcp_port
from tests.swarm import Swarm, wait_until

pytestmark = pytest.mark.timeout(150)

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,900", "--hide-scrollbars")
SHOTS = os.environ.get("CCSQ_CONSOLE_SCREENSHOTS", "")


def _no_browser(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI is set: the console's browser tests must run, not skip; .ci/run installs chromium)")
    pytest.skip(f"{why}: apt-get install chromium chromium-driver (and pip install selenium) to run the browser tests")


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Headless Chromium driven by the system chromedriver (selenium-manager never downloads)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None or not Path(CHROMEDRIVER).exists():
        _no_browser(f"no chromium ({chromium}) or no {CHROMEDRIVER}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _no_browser("selenium is not installed")
    monkeypatch.setenv("SE_OFFLINE", "true")  # selenium-manager: never reach the network
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(options=opts, service=service)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver, name: str) -> None:
    """Save a full-page PNG of the current page under $CCSQ_CONSOLE_SCREENSHOTS (if set)."""
    if not SHOTS:
        return
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, min(max(height + 20, 400), 2400))
    Path(SHOTS).mkdir(parents=True, exist_ok=True)
    path = Path(SHOTS) / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(1280, 900)
    try:  # docs/console/*.png stay small: a 256-colour palette is plenty for these pages
        from PIL import Image

        with Image.open(path) as im:
            im.convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(path, optimize=True)
    except ImportError:
        pass


def gap_report(swarm: Swarm) -> dict:
    """``ccsq gap-report --json``, the real command."""
    out = subprocess.run([bin_path("ccsq"), "gap-report", "--config", str(swarm.configs["brokerd"]), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode in (0, 3), out.stderr
    return json.loads(out.stdout)


def fast_admin(swarm: Swarm) -> Path:
    path = swarm.configs["admin"]
    path.write_text(path.read_text() + "connect_timeout_s = 0.5\nhello_timeout_s = 0.5\n")
    return path


def start_console(swarm: Swarm, *args: str, env: dict[str, str] | None = None) -> str:
    port = free_tcp_port()
    swarm.procs.start("console", [bin_path("ccsq"), "console", "--config", str(swarm.configs["admin"]),
                                  "--listen", f"127.0.0.1:{port}", *args], env=env, ready_event="console_started")
    return f"http://127.0.0.1:{port}"


def texts(driver, css: str) -> dict[str, str]:
    from selenium.webdriver.common.by import By

    attr = re.search(r"\[([a-z-]+)\]", css).group(1)  # type: ignore[union-attr]
    return {e.get_attribute(attr): e.text.strip() for e in driver.find_elements(By.CSS_SELECTOR, css)}


def check_numbers(driver, rep: dict) -> None:
    """The overview's counters, states and balance are gap-report's."""
    shown = texts(driver, "td[data-counter]")
    assert shown == {k: str(v) for k, v in rep["counters"].items()}
    states = texts(driver, "td[data-state]")
    assert states == {k: str(v) for k, v in rep["states"].items()}
    from selenium.webdriver.common.by import By

    bal = driver.find_element(By.ID, "balance")
    assert bal.get_attribute("data-balanced") == ("true" if rep["balanced"] else "false")
    assert ("balanced" in bal.text) and ("UNBALANCED" not in bal.text) == rep["balanced"]


def test_console_pages_match_gap_report_and_replay_from_the_page_completes(tmp_path: Path, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 30, poll_frequency=0.1)
    with Swarm(tmp_path, workers=1, broker={"accounting_sample_interval_s": 0.5}) as swarm:
        admin = fast_admin(swarm)
        swarm.start_broker()
        swarm.start_completion()
        with swarm.client() as client:
            ids = [client.submit(f"page {i}".encode(), "echo", key=f"scan-{i:04d}").item_id for i in range(6)]
            client.cancel([ids[0]])  # ready, no worker yet: dead (cancelled), gap event G7
            for i in range(3):  # a queue no worker serves, due in an hour: a backlog that does not drain
                client.submit(f"form {i}".encode(), "classify", deadline_ts=time.time() + 3600)
        swarm.start_worker(1)
        swarm.wait_acknowledged(5)
        url = start_console(swarm, "--refresh-s", "60")
        rebound = urllib.request.Request(url + "/", headers={"Host": "attacker.example"})
        with pytest.raises(urllib.error.HTTPError) as refused:  # no token: only loopback names are answered
            urllib.request.urlopen(rebound, timeout=30)
        assert refused.value.code == 403

        # overview: the accounting equation and every counter as gap-report says; a rate chart
        rep = gap_report(swarm)
        browser.get(url + "/")
        assert browser.find_element(By.ID, "source").text == "broker online"
        check_numbers(browser, rep)
        assert browser.find_element(By.CSS_SELECTOR, "meta[http-equiv=refresh]").get_attribute("content") == "60"
        lines = browser.find_elements(By.CSS_SELECTOR, "#chart svg polyline")
        assert {ln.get_attribute("data-counter") for ln in lines} == {"received", "routed", "completed", "acknowledged"}
        assert texts(browser, "a[data-gap]") == {w["id"]: f"{w['id']} {w['count']}" for w in rep["windows"] if w["count"]}
        assert texts(browser, "a[data-gap]")["G7"] == "G7 1"
        queue = browser.find_element(By.CSS_SELECTOR, "#queues tr[data-kind=echo]").text
        assert queue.startswith("echo 0 0") and "empty" in queue
        queue = browser.find_element(By.CSS_SELECTOR, "#queues tr[data-kind=classify]").text
        assert queue.startswith("classify 3 0") and "min" in queue and queue.endswith("stalled"), queue
        rates = texts(browser, "td[data-rate]")
        assert float(rates["acknowledged"]) > 0, rates
        shot(browser, "overview")

        # workers: the worker with its kind, slots, credit and a fresh heartbeat; the completion service
        browser.get(url + "/workers")
        row = browser.find_element(By.CSS_SELECTOR, "#peers tr[data-peer=worker-1]")
        cells = [td.text for td in row.find_elements(By.TAG_NAME, "td")]
        assert cells[1:4] == ["worker", "echo", "1"], cells
        assert float(row.find_element(By.CSS_SELECTOR, "td[data-col=heartbeat]").text.split()[0]) < 5
        assert browser.find_elements(By.CSS_SELECTOR, "#peers tr[data-peer=completion-1]")
        assert row.find_element(By.CSS_SELECTOR, "button[value=drain]")
        shot(browser, "workers")

        # items: search by idempotency key lands on the item; its record says acknowledged
        browser.get(url + "/items")
        browser.find_element(By.ID, "q").send_keys("scan-0003")
        browser.find_element(By.ID, "search").click()
        wait.until(lambda d: "/items/" in d.current_url)
        assert browser.find_element(By.ID, "item-id").text == ids[3]
        assert browser.find_element(By.ID, "item-state").text == "acknowledged"
        shot(browser, "item")
        browser.get(url + "/items?q=no-such-thing")
        assert "no-such-thing" in browser.find_element(By.ID, "not-found").text

        # the dead item: its gap event; then replay it from the dead-letter page, confirming
        browser.get(url + "/items/" + ids[0])
        assert browser.find_element(By.ID, "item-state").text == "dead"
        assert "G7" in browser.find_element(By.ID, "events").text
        browser.get(url + "/dlq")
        row = browser.find_element(By.CSS_SELECTOR, f"#dlq tr[data-item='{ids[0]}']")
        assert "cancelled" in row.text
        shot(browser, "dead-letters")
        row.find_element(By.CSS_SELECTOR, "button.replay").click()
        wait.until(lambda d: d.current_url.endswith("/confirm"))
        assert ids[0] in browser.find_element(By.TAG_NAME, "h1").text
        shot(browser, "confirm")
        browser.find_element(By.ID, "confirm").click()
        wait.until(lambda d: d.current_url.endswith("/dlq") and d.find_elements(By.ID, "flash"))
        assert browser.find_element(By.ID, "flash").text == f"replayed 1 item(s): {ids[0]}"
        settings = load(AdminConfig, admin)
        wait_until(lambda: admin_client.offline(settings.data_dir, "items_show", {"item_id": ids[0]})["item"]["state"] == "acknowledged",
                   60, "the replayed item to be acknowledged")
        browser.get(url + "/items/" + ids[0])
        assert browser.find_element(By.ID, "item-state").text == "acknowledged"
        assert "G10" in browser.find_element(By.ID, "events").text
        log = swarm.procs.tail("console")
        action = next(json.loads(ln) for ln in log.splitlines() if '"console_action"' in ln)
        assert (action["who"], action["action"], action["target"]) == ("local", "dlq_replay", ids[0])
        assert action["remote"].startswith("127.0.0.1:")

        # gap register: each window's count is gap-report's
        swarm.wait_acknowledged(6)
        rep = gap_report(swarm)
        assert rep["balanced"] and rep["states"]["ready"] == 3
        browser.get(url + "/gaps")
        assert texts(browser, "td[data-count]") == {w["id"]: str(w["count"]) for w in rep["windows"]}
        assert "`" not in browser.find_element(By.ID, "windows").text  # Markdown code is rendered, not shown
        shot(browser, "gap-register")
        browser.get(url + "/federation")
        assert browser.find_element(By.ID, "no-links").text == "no federation links configured"
        shot(browser, "federation")
        browser.get(url + "/")
        check_numbers(browser, rep)

        # the broker stops: the pages read the ledger, and still agree with gap-report
        swarm.procs.stop("completion")
        swarm.procs.stop("worker-1")
        swarm.procs.stop("broker")
        rep = gap_report(swarm)
        browser.get(url + "/")
        assert browser.find_element(By.ID, "source").text == "ledger (offline)"
        assert browser.find_element(By.ID, "offline")
        check_numbers(browser, rep)
        shot(browser, "overview-offline")
        browser.get(url + "/dlq")
        assert browser.find_element(By.ID, "dlq-empty")

        # the static report: opened in the same browser, the chart legend is inside the SVG
        html_path = tmp_path / "report.html"
        out = subprocess.run([bin_path("ccsq"), "gap-report", "--config", str(swarm.configs["brokerd"]), "--html", str(html_path)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        browser.get(html_path.as_uri())
        overflow = browser.execute_script(
            "const svg = document.querySelector('svg'); const w = svg.viewBox.baseVal.width, h = svg.viewBox.baseVal.height;"
            "return [...svg.querySelectorAll('text')].filter(t => { const b = t.getBBox();"
            " return b.x < 0 || b.y < 0 || b.x + b.width > w || b.y + b.height > h; }).map(t => t.textContent);")
        assert overflow == []
        legend = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "svg text[data-legend]")]
        assert legend == [f"{c} {rep['counters'][c]}" for c in ("received", "routed", "completed", "acknowledged")]
        assert not browser.find_elements(By.XPATH, "//td[contains(., '`')]")
        assert browser.find_elements(By.CSS_SELECTOR, "#windows code")
        shot(browser, "gap-report-html")
        assert swarm.procs.stop("console") == 0  # SIGTERM: a clean stop
        assert '"console_stopped"' in swarm.procs.tail("console")


def test_console_is_safe_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond loopback without a token: refused at start (exit 78). With tokens: no page
    without signing in; a state change needs the CSRF token of the session and the admin role."""
    from ccsq.tools import cli

    with Swarm(tmp_path, workers=1) as swarm:  # worker-1 is authorized, never started
        admin = fast_admin(swarm)
        monkeypatch.delenv("CCSQ_CONSOLE_TOKEN", raising=False)
        assert cli.main(["console", "--config", str(admin), "--listen", f"0.0.0.0:{free_tcp_port()}"]) == ExitCode.CONFIG
        from ccsq.console.main import build

        with pytest.raises(ConfigError, match="not a loopback address"):
            build(load(AdminConfig, admin), listen="[::]:8750", token=None, refresh_s=0)
        with pytest.raises(ConfigError, match="shorter than"):
            build(load(AdminConfig, admin), listen="0.0.0.0:8750", token="short", refresh_s=0)
        tokens = tmp_path / "console-tokens.toml"
        tokens.write_text('[tokens.alice]\ntoken = "alice-admin-token-0123456789"\nrole = "admin"\n'
                          '[tokens.bob]\ntoken = "bob-viewer-token-0123456789"\nrole = "viewer"\n')
        tokens.chmod(0o644)
        admin.write_text(admin.read_text() + f'console_tokens = "{tokens}"\n')
        with pytest.raises(ConfigError, match="chmod 600"):
            build(load(AdminConfig, admin), listen="127.0.0.1:8750", token=None, refresh_s=0)
        tokens.chmod(0o600)

        swarm.start_broker()
        with swarm.client() as client:
            item = client.submit(b"x", "nobody-serves-this").item_id
            client.cancel([item])
            stuck = client.submit(b"y", "nobody-serves-this").item_id  # waits in ready: the console cancels it
        url = start_console(swarm, "--refresh-s", "0")

        def opener() -> urllib.request.OpenerDirector:
            return urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()), _NoRedirect)

        def get(o, path: str, headers: dict | None = None) -> tuple[int, str, dict]:
            req = urllib.request.Request(url + path, headers=headers or {})
            try:
                with o.open(req, timeout=30) as r:
                    return r.status, r.read().decode(), dict(r.headers)
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode(), dict(exc.headers)

        def post(o, path: str, form: dict, headers: dict | None = None) -> tuple[int, str, dict]:
            req = urllib.request.Request(url + path, data=urllib.parse.urlencode(form).encode(), method="POST", headers=headers or {})
            try:
                with o.open(req, timeout=30) as r:
                    return r.status, r.read().decode(), dict(r.headers)
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode(), dict(exc.headers)

        anon = opener()
        code, _, headers = get(anon, "/dlq")
        assert code == 303 and headers["location"].startswith("/login")
        # a script with a wrong token (or another scheme) gets 401 + WWW-Authenticate, not a redirect to /login
        for authz in ("Bearer alice-admin-token-012345678X", "Bearer ", "Basic YWxpY2U6eA=="):
            code, _, headers = get(anon, "/dlq", {"Authorization": authz})
            assert code == 401 and headers["www-authenticate"].startswith("Bearer realm="), (authz, code)
        code, _, headers = post(anon, "/confirm", {"action": "dlq_purge", "target": item}, {"Authorization": "Bearer nope"})
        assert code == 401 and "invalid_token" in headers["www-authenticate"]
        assert get(anon, "/", {"Authorization": "Bearer alice-admin-token-0123456789"})[0] == 200
        assert post(anon, "/login", {"token": "wrong-token-0123456789"})[0] == 401
        assert post(anon, "/confirm", {"action": "dlq_purge", "target": item})[0] == 401

        bob = opener()
        code, _, headers = post(bob, "/login?next=/dlq", {"token": "bob-viewer-token-0123456789"})
        assert code == 303 and headers["location"] == "/dlq" and "HttpOnly" in headers["set-cookie"]
        code, page, headers = get(bob, "/dlq")
        assert code == 200 and item in page and "bob (viewer)" in page and "replay" not in re.sub(r"<p class=\"small\">.*?</p>", "", page)
        assert "default-src 'none'" in headers["content-security-policy"]
        csrf = re.search(r'name="csrf" value="([^"]+)"', page)
        assert csrf is None  # a viewer gets no action forms
        assert post(bob, "/confirm", {"action": "dlq_purge", "target": item, "csrf": "x"})[0] == 403  # CSRF
        bearer = {"Authorization": "Bearer bob-viewer-token-0123456789"}
        code, page, _ = post(anon, "/confirm", {"action": "dlq_purge", "target": item}, bearer)
        assert code == 403 and "needs the admin role" in page

        alice = opener()
        assert post(alice, "/login", {"token": "alice-admin-token-0123456789"})[0] == 303
        code, page, _ = get(alice, "/dlq")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
        assert post(alice, "/confirm", {"action": "dlq_purge", "target": item, "csrf": "forged"})[0] == 403
        code, page, _ = post(alice, "/confirm", {"action": "dlq_purge", "target": item, "csrf": csrf})
        assert code == 200 and "cannot be undone" in page
        assert post(alice, "/apply", {"action": "dlq_purge", "target": item, "csrf": csrf})[0] == 400  # not confirmed
        assert admin_client.offline(load(AdminConfig, admin).data_dir, "dlq_list")["total"] == 1
        code, _, headers = post(alice, "/apply", {"action": "dlq_purge", "target": item, "csrf": csrf, "confirm": "yes"})
        assert code == 303 and headers["location"] == "/dlq"
        assert admin_client.offline(load(AdminConfig, admin).data_dir, "dlq_list")["total"] == 0
        code, page, _ = post(alice, "/confirm", {"action": "drain", "target": "worker-1", "csrf": csrf})
        assert code == 200 and "stops dispatching" in page
        assert post(alice, "/apply", {"action": "drain", "target": "worker-1", "csrf": csrf, "confirm": "yes"})[0] == 303
        assert admin_client.offline(load(AdminConfig, admin).data_dir, "status")["draining"] == ["worker-1"]
        code, page, _ = get(alice, "/workers")
        assert "Drained but not connected" in page and 'value="undrain"' in page
        # a ready item's page offers cancel (confirm, then apply), a dead one's does not
        code, page, _ = get(alice, f"/items/{stuck}")
        assert code == 200 and 'value="items_cancel"' in page
        assert 'value="items_cancel"' not in get(alice, f"/items/{item}")[1]
        assert post(alice, "/confirm", {"action": "items_cancel", "target": "*", "csrf": csrf})[0] == 400
        code, page, _ = post(alice, "/confirm", {"action": "items_cancel", "target": stuck, "csrf": csrf})
        assert code == 200 and "reason cancelled" in page and f'href="/items/{stuck}" id="cancel">Keep it' in page
        assert post(alice, "/confirm", {"action": "items_cancel", "target": stuck, "csrf": "forged"})[0] == 403
        assert admin_client.offline(load(AdminConfig, admin).data_dir, "items_show", {"item_id": stuck})["item"]["state"] == "ready"
        code, _, headers = post(alice, "/apply", {"action": "items_cancel", "target": stuck, "csrf": csrf, "confirm": "yes"})
        assert code == 303 and headers["location"] == f"/items/{stuck}"
        rec = admin_client.offline(load(AdminConfig, admin).data_dir, "items_show", {"item_id": stuck})["item"]
        assert (rec["state"], rec["error"]) == ("dead", "cancelled")
        code, page, _ = get(alice, f"/items/{stuck}")
        assert "cancelled (dead, reason cancelled)" in page and 'value="dlq_replay"' in page  # the flash, then a dead item's forms
        events = [json.loads(ln) for ln in swarm.procs.tail("console").splitlines() if ln.startswith("{")]
        assert any(e["event"] == "console_action" and e["who"] == "alice" and e["action"] == "dlq_purge" for e in events)
        assert any(e["event"] == "console_action_refused" and e["who"] == "bob" for e in events)
        assert any(e["event"] == "console_csrf_refused" and e["who"] == "bob" for e in events)
        assert any(e["event"] == "console_login_refused" for e in events)


def test_pages_render_fields_other_parts_add(tmp_path: Path) -> None:
    """Fields the status reply may grow (a worker's claim-store health, federation links)
    render when present, and their absence says so."""
    from ccsq.console.app import Auth, Console, Viewer
    from ccsq.console.data import Source

    (tmp_path / "admin.toml").write_text('peer_id = "admin"\nprivate_key = "k"\n')
    console = Console(Source(load(AdminConfig, tmp_path / "admin.toml")), Auth([]))
    viewer = Viewer("local", "admin", csrf="c")
    peer = {"peer_id": "worker-1", "role": "worker", "kinds": ["ocr"], "slots": 1, "busy": 0, "credit": 2, "leases": 0,
            "lease_list": [], "in_flight": 0, "done": 0, "last_seen_s": 0.1, "connected_s": 9.0, "healthy": True, "draining": False}

    def render(name: str, **ctx) -> str:
        return console.env.get_template(name).render(viewer=viewer, flash=[], path="/", refresh_s=0, now="", **ctx)

    plain = render("workers.html", status={"source": "broker", "peers": [peer]}, peers=[peer], store_key=None, me="admin", drained_away=[])
    assert "unhealthy store" not in plain
    sick = dict(peer, store_unhealthy="file:///srv/blobs: no such directory")
    page = render("workers.html", status={"source": "broker", "peers": [sick]}, peers=[sick], store_key="store_unhealthy", me="admin",
                  drained_away=[])
    assert "unhealthy store" in page and "file:///srv/blobs: no such directory" in page
    none = render("federation.html", status={"source": "broker"}, status_error="", links=[], columns=[])
    assert "no federation links configured" in none
    link = {"link": "a->b", "in_flight": 3}
    page = render("federation.html", status={"source": "broker"}, status_error="", links=[link], columns=list(link))
    assert "a-&gt;b" in page and "no federation links" not in page
    # a relay peer whose link a swarm refused (its heartbeat info): the page says so (issue 22, defect 5)
    from ccsq.console.app import relay_links

    relay = {"peer_id": "relay-a-to-b-up", "role": "relay", "kinds": ["ocr"], "credit": 0, "leases": 0, "healthy": False,
             "info": {"relay_side": "upstream", "link": "a-to-b", "link_broken": "downstream refused our origin: bad key",
                      "link_broken_since": 1_700_000_000, "link_broken_fix": "fix trusted_swarms"}}
    rows = relay_links([relay, {"peer_id": "worker-1", "role": "worker"}])
    assert [r["peer"] for r in rows] == ["relay-a-to-b-up"] and rows[0]["healthy"] == "NO"
    page = render("federation.html", status={"source": "broker"}, status_error="", links=rows, columns=list(rows[0]))
    assert "federation link a-to-b BROKEN since 2023-11-14 22:13:20 UTC" in page and "fix trusted_swarms" in page
    console.source.close()


def test_static_report_legend_fits_and_renders_code() -> None:
    """gap-report --html: the legend carries whole numbers and wraps rather than running
    off the chart; Markdown `code` in the gap-register texts becomes <code>."""
    from ccsq.brokerd.gap_report import _LEGEND_CHAR_PX, inline_code_html, render_chart_svg

    for n in (79, 123_456_789_012):
        counters = {"received": n, "routed": n, "completed": n, "acknowledged": n}
        svg = render_chart_svg([{"ts_ms": 0, **dict.fromkeys(counters, 0)}], now_ms=60_000, counters=counters)
        width = int(re.search(r'viewBox="0 0 (\d+) ', svg).group(1))  # type: ignore[union-attr]
        for c in counters:
            m = re.search(rf'<text x="([\d.]+)" y="[\d.]+" font-size="12" data-legend="{c}">([^<]+)</text>', svg)
            assert m is not None and m.group(2) == f"{c} {n}"
            assert float(m.group(1)) + _LEGEND_CHAR_PX * len(m.group(2)) <= width
    assert inline_code_html("run `ccsq dlq replay` <now>") == "run <code>ccsq dlq replay</code> &lt;now&gt;"
    assert inline_code_html("a ` alone") == "a ` alone"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # noqa: ANN002, ANN003 - keep 303s visible to the test
        return None


if __name__ == "__main__":  # pragma: no cover - CCSQ_CONSOLE_SCREENSHOTS=docs/console python -m tests.test_console
    sys.exit(pytest.main([__file__, "-q"]))
