"""The circuit view: one self-contained string (no external resources), one edge per ranked edge with its
mean score in the hover title and in the embedded JSON, equal to the result's summary; a top-n slider."""

import json
import re

import reward_lens
from reward_lens import edge_attribution


def test_html_numbers_parse_back():
    model, pairs = reward_lens.load_demo_model(device="cpu"), reward_lens.demo.demo_pairs()[:3]
    res = edge_attribution(model, pairs, method="eap")
    page = res._repr_html_()
    assert page == res.html()
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # offline
    assert 'type="range"' in page and "<svg" in page
    table = res.summary().head(200)
    titles = re.findall(r"<title>(\S+) -&gt; (\S+): score=(\S+) normalized=(\S+)</title>", page)
    assert len(titles) == len(table)
    for (s, r, score, norm), row in zip(titles, table.itertuples()):
        assert (s, r) == (row.sender, row.receiver)
        assert float(score) == row.mean_score and float(norm) == row.mean_normalized_score
    data = json.loads(
        re.search(r'<script type="application/json" class="edges">(.*?)</script>', page).group(1)
    )
    assert [d["score"] for d in data] == [float(v) for v in table.mean_score]
    ranks = [int(v) for v in re.findall(r'data-rank="(\d+)"', page)]
    assert ranks == list(range(len(table)))
