"""The attribution graph's HTML view in a real browser (headless Chromium through selenium), in a 1280-pixel
window: the numbers the page draws (each node's data-value / data-influence, each edge's title) equal the
graph's frames, nothing overflows sideways, no console errors, clicking a node highlights its paths to the
reward and the slider hides edges. Skips, with the install command, where no browser exists."""

import re
import shutil

import numpy as np
import pytest

import reward_lens as rl

INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium"
WIDTH = 1280


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip(f"selenium is not installed; to run the browser test: {INSTALL}")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip(f"no Chromium / chromedriver on PATH; to run the browser test: {INSTALL}")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    opts.add_argument(f"--window-size={WIDTH},900")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(driver), options=opts)
    yield drv
    drv.quit()


READ = """
const nodes = Array.from(document.querySelectorAll('circle[data-node]')).map(c =>
  [c.dataset.node, +c.dataset.value, +c.dataset.influence]);
const edges = Array.from(document.querySelectorAll('line[data-rank]')).map(l =>
  [l.querySelector('title').textContent, l.style.display]);
const doc = document.documentElement;
return {nodes: nodes, edges: edges, client: doc.clientWidth, scroll: doc.scrollWidth,
        inner: window.innerWidth};
"""

EDGE = re.compile(r"^(\S+) -> (\S+): weight=(\S+)$")


def test_graph_view_in_a_browser(browser, tmp_path):
    model = rl.load_demo_model()
    pair = rl.demo_pairs()[5]
    graph = rl.attribution_graph(model, pair.prompt, pair.chosen).prune()
    page = tmp_path / "graph.html"
    page.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'></head><body>{graph.html()}</body></html>"
    )
    browser.get(page.resolve().as_uri())
    seen = browser.execute_script(READ)
    assert seen["inner"] == WIDTH and seen["scroll"] <= seen["client"], seen["scroll"]
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors

    nodes = graph.nodes
    assert [n for n, _, _ in seen["nodes"]] == list(nodes.node)
    assert np.allclose([v for _, v, _ in seen["nodes"]], nodes.value, rtol=1e-12, atol=0)
    assert np.allclose([i for _, _, i in seen["nodes"]], nodes.influence, rtol=1e-12, atol=0)
    drawn = {}
    for title, _ in seen["edges"]:
        source, target, weight = EDGE.match(title).groups()
        drawn[(source, target)] = float(weight)
    frame = {(e.source, e.target): e.weight for e in graph.edges.itertuples()}
    assert drawn.keys() == frame.keys()
    assert all(abs(drawn[k] - frame[k]) <= 1e-12 * abs(frame[k]) for k in frame)
    shown = sum(d != "none" for _, d in seen["edges"])
    assert shown == min(200, len(frame))

    # click the most influential token: its paths light up and end at the reward
    token = nodes[nodes.kind == "embed"].sort_values("influence").node.iloc[-1]
    browser.execute_script(
        "document.querySelector(`circle[data-node='${arguments[0]}']`).dispatchEvent(new Event('click'))",
        token,
    )
    lit = browser.execute_script(
        "return Array.from(document.querySelectorAll('circle[data-node]:not(.off)')).map(c => c.dataset.node)"
    )
    assert token in lit and "reward" in lit and len(lit) < len(nodes)
    # the slider at 0 hides every edge
    browser.execute_script(
        "const s = document.querySelector('.rl-graph input[type=range]'); s.value = 0;"
        "s.dispatchEvent(new Event('input'))"
    )
    hidden = browser.execute_script(
        "return Array.from(document.querySelectorAll('line[data-rank]'))"
        ".every(l => l.style.display === 'none')"
    )
    assert hidden
    assert not [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]


def test_feature_graph_view_shows_a_clicked_features_texts(browser, tmp_path):
    """The feature graph's view: the most influential feature's texts shown at first; clicking another
    feature shows its panel alone, with as many texts as the embedded JSON lists for it."""
    import json

    model, tc = rl.load_demo_model(), rl.load_transcoders("demo")
    pair = rl.demo_pairs()[5]
    ids = model.to_tokens(pair.prompt, pair.chosen)["input_ids"][0][-12:]
    graph = rl.attribution_graph(model, input_ids=ids, transcoders=tc)
    html = graph.html(texts=rl.demo_pairs()[:20], k=3)
    page = tmp_path / "features.html"
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'></head><body>{html}</body></html>")
    browser.get(page.resolve().as_uri())
    visible = (
        "return Array.from(document.querySelectorAll('div[data-examples]')).filter(d => !d.hidden)"
        ".map(d => [d.dataset.examples, d.querySelectorAll('li').length])"
    )
    shown = graph.prune().nodes
    features = shown[shown.kind == "feature"].sort_values("influence", ascending=False)
    first = features.node.iloc[0].split("@")[0]
    data = json.loads(html.split('class="graph-data">')[1].split("</script>")[0].replace("<\\/", "</"))
    listed = {e["component"] for e in data["examples"]}
    assert [name for name, _ in browser.execute_script(visible)] == ([first] if first in listed else [])
    other = next(n for n in features.node if n.split("@")[0] != first)
    browser.execute_script(
        "document.querySelector(`circle[data-node='${arguments[0]}']`).dispatchEvent(new Event('click'))",
        other,
    )
    component = other.split("@")[0]
    count = sum(e["component"] == component for e in data["examples"])
    assert browser.execute_script(visible) == ([[component, count]] if count else [])
    assert not [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
