"""The KV tab says what it draws (issue 52.7): the block size in its help is the engine's, the
help and the map's legend describe a shared block alike, and the block tables say their
numbers are physical block ids."""
from pathlib import Path

import numpy as np

from ui_helpers import make_snapshot  # noqa: I001  (puts the repo on sys.path)
from views.figures_kv import block_tables_html
from views.kv_cache import kv_help

MAP_JS = (Path(__file__).resolve().parents[1] / "views" / "kv_map.js").read_text()


def test_help_names_the_engines_block_size():
    text = kv_help(16)
    assert "16 token slots" in text and "block size" not in text


def test_help_and_legend_draw_a_shared_block_alike():
    text = kv_help(16)
    for mark in ("dark border", "white dot"):
        assert mark in text and mark in MAP_JS, mark
    assert "a dot = shared" not in text


def test_block_tables_are_headed_as_physical_block_ids():
    html = block_tables_html(make_snapshot(np.random.default_rng(0)))
    assert "physical block ids" in html
    assert html.index("physical block ids") < html.index('class="kv-trow"')
