"""The audit's report.html in a real browser (headless Chromium through selenium), in a 1280-pixel window:
no horizontal overflow, every figure loads, no console errors, and the token heatmaps' hover values (each
token's title) equal token_attribution.csv. Skips, with the install command, where no browser exists."""

import json
import re
import shutil

import pandas as pd
import pytest

import reward_lens as rl
from reward_lens.app.audit import run_audit
from reward_lens.app.cli import main as cli_main

INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium"
WIDTH = 1280


def _browser_paths():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    return chromium, driver


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip(f"selenium is not installed; to run the browser test: {INSTALL}")
    chromium, driver = _browser_paths()
    if not chromium or not driver:
        pytest.skip(f"no Chromium / chromedriver on PATH; to run the browser test: {INSTALL}")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={WIDTH},900",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(driver), options=opts)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Two reports: the demo audit (faithfulness and distortion tables, token heatmaps) and an RM-Bench
    file's audit through the CLI (the benchmark section and its misses)."""
    root = tmp_path_factory.mktemp("browser")
    model = rl.load_demo_model(device="cpu")
    run_audit(model, rl.demo_pairs()[::8], root / "demo", echo=lambda line: None)
    pairs = rl.demo_pairs()[::40]
    rows = [
        {
            "id": f"r{i}",
            "prompt": p.prompt,
            "domain": p.subset,
            "chosen": [p.chosen, p.chosen + " Let me add a little more context.", "**" + p.chosen + "**"],
            "rejected": [
                p.rejected,
                p.rejected + " Let me add a little more context.",
                "**" + p.rejected + "**",
            ],
        }
        for i, p in enumerate(pairs)
    ]
    src = root / "rmbench.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows))
    assert cli_main(["audit", "--pairs", str(src), "--out", str(root / "rmbench")]) == 0
    return {"demo": root / "demo", "rmbench": root / "rmbench"}


LAYOUT = """
const doc = document.documentElement;
return {client: doc.clientWidth, scroll: doc.scrollWidth, inner: window.innerWidth,
        images: Array.from(document.images).map(i => [i.complete, i.naturalWidth]),
        sections: Array.from(document.querySelectorAll('h2')).map(h => h.textContent)};
"""

HEATMAP = """
const out = [];
document.querySelectorAll('.rl-tokens table').forEach(t => {
  const pair = t.previousElementSibling.textContent;
  t.querySelectorAll('td').forEach(td => {
    const side = td.querySelector('b').textContent;
    const titles = Array.from(td.querySelectorAll('span')).map(s => s.getAttribute('title'));
    out.push([pair, side, titles]);
  });
});
return out;
"""


@pytest.mark.parametrize("name", ["demo", "rmbench"])
def test_report_in_a_browser(browser, reports, name):
    out = reports[name]
    browser.get((out / "report.html").resolve().as_uri())
    layout = browser.execute_script(LAYOUT)
    assert layout["inner"] == WIDTH
    assert layout["scroll"] <= layout["client"], f"page is {layout['scroll']} px wide in a {WIDTH} px window"
    assert layout["images"] and all(ok and w > 0 for ok, w in layout["images"]), layout["images"]
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
    if name == "rmbench":
        assert "Benchmark: rmbench" in layout["sections"]

    csv = pd.read_csv(out / "token_attribution.csv", keep_default_na=False)
    cells = browser.execute_script(HEATMAP)
    assert cells, "the report has no token heatmap"
    for pair, side, titles in cells:
        want = csv[(csv.pair == pair) & (csv.side == side)].sort_values("position")
        assert len(titles) == len(want) > 0, (pair, side)
        for title, (pos, value) in zip(titles, zip(want.position, want.value)):
            m = re.fullmatch(r"position (\d+): ([+-]\d+\.\d+)", title)
            assert m, title
            assert int(m.group(1)) == pos
            assert float(m.group(2)) == pytest.approx(value, abs=5e-6)  # the title shows 5 decimals


READING = """
const firstH2 = document.querySelector('h2');
const firstTable = document.querySelector('table');
const findings = document.querySelector('ul.findings');
const cell = document.querySelector('.table-wrap td');
const style = getComputedStyle(cell);
return {inner: window.innerWidth, scroll: document.documentElement.scrollWidth,
        client: document.documentElement.clientWidth,
        first: firstH2.textContent, findings: findings ? findings.innerText : '',
        findings_before_tables: !!findings &&
            (findings.compareDocumentPosition(firstTable) & Node.DOCUMENT_POSITION_FOLLOWING) > 0,
        font: parseFloat(getComputedStyle(document.querySelector('p')).fontSize),
        wrap: style.overflowWrap, wordBreak: style.wordBreak,
        wide: Array.from(document.body.querySelectorAll('*')).filter(
            e => e.getBoundingClientRect().right > window.innerWidth + 0.5 &&
                 !e.closest('.table-wrap') && !e.closest('.rl-tokens')).map(e => e.tagName)};
"""


@pytest.mark.parametrize("width,mobile", [(390, True), (1280, False)])
def test_report_reads_on_a_phone_and_a_desktop_finding_first(browser, reports, width, mobile):
    """Emulated as a phone (390 CSS px, mobile: without the viewport tag Chromium would lay the page out
    at 980 px and shrink it) and a 1280 px window: no sideways scrolling, no element past the right edge
    outside a table's own scroll box, readable text, table cells that never break inside a word; the
    finding, in words, comes before any table."""
    metrics = {"width": width, "height": 900, "deviceScaleFactor": 3 if mobile else 1, "mobile": mobile}
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    try:
        browser.get((reports["demo"] / "report.html").resolve().as_uri())
        got = browser.execute_script(READING)
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    assert got["inner"] == width, f"laid out at {got['inner']} px, not the device's {width} (viewport tag?)"
    assert got["scroll"] <= got["client"], f"page is {got['scroll']} px wide at {width} px"
    assert got["wide"] == [], got["wide"]
    assert got["font"] >= 14
    assert got["wrap"] == "normal" and got["wordBreak"] == "normal"
    assert got["first"] == "What the audit found" and got["findings_before_tables"]
    text = got["findings"]
    assert "rewards sycophancy" in text and "rewards length" in text and "95% CI" in text
    assert "Attribution and patching" in text and "ρ = " in text
