"""docs/audit_report.png: the demo audit's report.html as headless Chromium shows it at 1280 px (the top of the
page: the finding and the first sections), with docs/audit_report.json naming the report's sections and the
PNG's SHA-256, so `tests/test_readme.py` can check the picture is of the current report.

    python scripts/render_audit_report_png.py        # needs chromium, chromium-driver and selenium

Deterministic audit (the demo model on every 8th of its pairs, one thread); about a minute on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PNG = ROOT / "docs" / "audit_report.png"
SIDECAR = ROOT / "docs" / "audit_report.json"
WIDTH, HEIGHT = 1280, 2400
PAIRS = slice(None, None, 8)  # the audit the picture shows: every 8th demo pair


def demo_report(out: Path):
    """The demo audit the picture shows, written into `out`; its AuditResult."""
    import torch

    from reward_lens.app.audit import run_audit
    from reward_lens.demo import demo_pairs, load_demo_model

    torch.set_num_threads(1)
    return run_audit(load_demo_model(device="cpu"), demo_pairs()[PAIRS], out, echo=lambda line: None)


def section_titles(html_text: str) -> list:
    import re

    return re.findall(r"<h2>(.*?)</h2>", html_text)


def main() -> int:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report"
        demo_report(out)
        page = out / "report.html"
        opts = webdriver.ChromeOptions()
        opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={WIDTH},{HEIGHT}"):
            opts.add_argument(arg)
        drv = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
        try:
            drv.get(page.resolve().as_uri())
            drv.save_screenshot(str(PNG))
        finally:
            drv.quit()
        titles = section_titles(page.read_text(encoding="utf-8"))
    digest = hashlib.sha256(PNG.read_bytes()).hexdigest()
    record = {
        "sections": titles,
        "png_sha256": digest,
        "width": WIDTH,
        "height": HEIGHT,
        "pairs": "demo[::8]",
    }
    SIDECAR.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {PNG} and {SIDECAR} ({len(titles)} sections)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
