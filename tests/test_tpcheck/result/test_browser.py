"""The HTML report in a real browser: headless Chromium, driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: no port, no extra Python package). Checks that the chart and the table render,
that the page logs no console error or exception, and that it makes no network request (every request the
page issues is recorded; only its own ``file://`` URL is allowed). A screenshot of a failing report goes to
the test's tmp dir and to ``reports/``.

Needs ``chromium`` on PATH (``apt-get install -y chromium``); skipped with the reason when it is absent."""
from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tpcheck.result.report.html import write_html
from tpcheck.result.report.sample import sample_result
from tpcheck.result.table import COLUMNS, DiffResult

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (apt-get install -y chromium)")
REPO = Path(__file__).resolve().parents[3]


class Browser:
    """A headless Chromium and one page, over the DevTools protocol on fds 3 (in) and 4 (out)."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 1400):
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()

        def fds():  # in the child: the pipe ends as fds 3 and 4 (via high fds, so neither clobbers the other)
            a = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 20)
            b = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 20)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.stderr = open(profile.parent / "chromium-stderr.log", "wb")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--disable-extensions", "--disable-quic", "--mute-audio", "--hide-scrollbars",
             # nothing can leave the machine even if a request were made: every host name fails to resolve
             "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE localhost",
             f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.stderr, pass_fds=(3, 4),
            preexec_fn=fds)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf, self._id, self.events = b"", 0, []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("no answer from Chromium (see chromium-stderr.log)")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, session: bool = False, timeout: float = 30, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            m = self._read(deadline)
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_event(self, method: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        for m in self.events:
            if m.get("method") == method:
                return m
        while True:
            m = self._read(deadline)
            self.events.append(m)
            if m.get("method") == method:
                return m

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        try:
            while True:
                self.events.append(self._read(deadline))
        except TimeoutError:
            pass

    def open(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")
        self.drain(0.5)  # late console messages, late requests

    def evaluate(self, expr: str):
        r = self.call("Runtime.evaluate", session=True, expression=expr, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    # what the page did
    def errors(self) -> list[str]:
        out = []
        for m in self.events:
            p, meth = m.get("params", {}), m.get("method")
            if meth == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif meth == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
                out.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description")))
                                                                for a in p.get("args", [])))
            elif meth == "Log.entryAdded" and p["entry"].get("level") in ("error", "warning"):
                out.append(f"log {p['entry']['level']}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    def requests(self) -> list[str]:
        return [m["params"]["request"]["url"] for m in self.events if m.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)
        self.stderr.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Browser(tmp_path_factory.mktemp("chromium") / "profile")
    yield b
    b.close()


def _result(fail: bool) -> DiffResult:
    """6 layers, 2 decode steps, isolate; failing: layers.2.attn.q_rope leaves the noise floor. The meta
    carries markup that must show as text."""
    return sample_result(6, 2, True, fail_at="layers.2.attn.q_rope" if fail else None,
                         meta={"model": "/ckpt/<script>alert(1)</script>", "prompt": "hello",
                               "command": "tpcheck diff --prompt '<b>x</b>'"})


def _check_page(browser, path: Path, want_fail: bool) -> dict:
    browser.open(path.as_uri())
    state = browser.evaluate("""JSON.stringify({
        rendered: document.body.getAttribute('data-rendered'),
        charts: document.querySelectorAll('figure.chart svg polyline').length,
        visibleChart: [...document.querySelectorAll('figure.chart')].filter(f => !f.hidden && f.getBoundingClientRect().height > 100).length,
        heat: document.querySelectorAll('svg.heatmap rect').length,
        origin: document.querySelectorAll('figure.chart:not([hidden]) g.origin').length,
        originLabel: (document.querySelector('figure.chart:not([hidden]) .origin-label') || {}).textContent || '',
        tableRows: document.querySelectorAll('#rows tbody tr').length,
        failRows: document.querySelectorAll('#rows tbody tr.fail').length,
        headers: document.querySelectorAll('#rows thead th').length,
        info: document.getElementById('f-info').textContent,
        verdict: document.getElementById('verdict').textContent,
        scripts: document.querySelectorAll('script').length,
        injected: document.querySelectorAll('#command b, dl.meta script').length,
        literal: document.body.textContent.includes('/ckpt/<script>alert(1)</script>'),
        badge: getComputedStyle(document.getElementById('verdict')).backgroundColor,
        sticky: getComputedStyle(document.querySelector('#rows thead th')).position,
    })""")
    state = json.loads(state)
    assert state["rendered"] == "1", state
    assert state["charts"] >= 3 and state["visibleChart"] == 1, state
    # every column of the table (tpcheck.result.COLUMNS but the unsaved execution order) is a header
    assert state["heat"] > 0 and state["headers"] == len([c for c in COLUMNS if c != "order"]) == 44, state
    assert state["tableRows"] > 0, state
    assert state["verdict"] == ("FAIL" if want_fail else "PASS")
    assert state["injected"] == 0 and state["scripts"] == 2 and state["literal"], "user-provided text became markup"
    # the inlined stylesheet (static/report.css) applies: the CSP lets it in
    assert state["badge"] == ("rgb(198, 40, 40)" if want_fail else "rgb(46, 125, 50)") and state["sticky"] == "sticky", state
    assert browser.errors() == [], browser.errors()
    assert browser.requests() == [path.as_uri()], f"network requests: {browser.requests()}"
    return state


def test_failing_report_renders_offline_and_marks_the_origin(browser, tmp_path):
    path = write_html(_result(fail=True), tmp_path / "fail.html")
    state = _check_page(browser, path, want_fail=True)
    assert state["origin"] == 1 and "layers.2.attn.q_rope" in state["originLabel"], state
    assert state["failRows"] == state["tableRows"]  # a failing report opens on the failing rows
    # sorting and filtering work: click excess, filter a point, everything rows
    browser.evaluate("document.getElementById('f-fail').click()")
    browser.evaluate("document.querySelector('#rows thead th[data-col=excess]').click()")
    col = browser.evaluate("[...document.querySelectorAll('#rows thead th')].findIndex(h => h.dataset.col == 'excess')")
    excess = browser.evaluate(f"[...document.querySelectorAll('#rows tbody tr')].map(r => +r.children[{col}].textContent)")
    assert len(excess) == 250 and excess == sorted(excess, reverse=True) and excess[0] > 1e4, excess[:5]
    browser.evaluate("var i=document.getElementById('f-text'); i.value='layers.5.mlp'; i.dispatchEvent(new Event('input'))")
    points = browser.evaluate("[...document.querySelectorAll('#rows tbody tr td:first-child')].map(t => t.textContent)")
    assert points and all(p.startswith("layers.5.mlp") for p in points)
    browser.evaluate("window.scrollTo(0, 0)")
    shot = browser.screenshot(tmp_path / "failing-report.png")
    out = REPO / "reports" / "failing-report.png"
    out.parent.mkdir(exist_ok=True)
    shutil.copy(shot, out)
    assert shot.stat().st_size > 10_000
    assert browser.errors() == [] and browser.requests() == [path.as_uri()]


def test_passing_report_renders_offline(browser, tmp_path):
    path = write_html(_result(fail=False), tmp_path / "pass.html")
    state = _check_page(browser, path, want_fail=False)
    assert state["origin"] == 0 and state["failRows"] == 0


def test_detector_sees_a_network_request_and_a_console_error(browser, tmp_path):
    """The checks above would catch a page that fetches something or logs an error."""
    page = tmp_path / "leaky.html"
    page.write_text('<!DOCTYPE html><html><head><link rel="icon" href="data:,"></head><body>'
                    '<img src="http://tpcheck.invalid/pixel.png"><script>console.error("boom")</script></body></html>')
    browser.open(page.as_uri())
    assert any(u.startswith("http://tpcheck.invalid/") for u in browser.requests()), browser.requests()
    assert any("boom" in m for m in browser.errors()), browser.errors()


def test_the_content_security_policy_blocks_fetches(browser, tmp_path):
    """A report-like page whose markup asks for an external image: the CSP blocks it (and says so)."""
    html = write_html(_result(fail=False), tmp_path / "r.html").read_text()
    html = html.replace("<main>", '<main><img src="http://tpcheck.invalid/pixel.png">', 1)
    (tmp_path / "csp.html").write_text(html)
    browser.open((tmp_path / "csp.html").as_uri())
    ids = {m["params"]["requestId"] for m in browser.events if m.get("method") == "Network.requestWillBeSent"
           and m["params"]["request"]["url"].startswith("http")}
    blocked = {m["params"]["requestId"] for m in browser.events if m.get("method") == "Network.loadingFailed"
               and m["params"].get("blockedReason") == "csp"}
    assert ids and ids <= blocked, [m for m in browser.events if m.get("method", "").startswith("Network.")]
    assert any("Content Security Policy" in m for m in browser.errors()), browser.errors()


def test_sweep_page_renders_offline(browser, tmp_path):
    from tpcheck.result.report.html import render_sweep_html
    rows = [{"config": "tiny", "tp": tp, "dtype": "float32", "decode_steps": 2, "passed": tp != 2} for tp in (1, 2, 4)]
    page = tmp_path / "index.html"
    page.write_text(render_sweep_html(rows, ["a.html", "b.html", None]))
    browser.open(page.as_uri())
    cells = browser.evaluate("[...document.querySelectorAll('#matrix td a')].map(a => a.textContent + ' ' + a.getAttribute('href'))")
    assert cells == ["PASS a.html", "FAIL b.html"]
    colors = browser.evaluate("[...document.querySelectorAll('#matrix td.pass, #matrix td.fail')]"
                              ".map(td => getComputedStyle(td).backgroundColor)")
    assert colors == ["rgb(232, 245, 233)", "rgb(253, 232, 232)", "rgb(232, 245, 233)"], colors  # the stylesheet applies here too
    assert browser.errors() == [] and browser.requests() == [page.as_uri()]
