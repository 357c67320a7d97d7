"""The What-if form's "Try this" list and the guided tour, without a browser (issue 52): found
effects are read back from the per-checkpoint cache, labelled as the buttons show them, and a
real checkpoint's tour has no demo-specific step."""
import json

from ui_helpers import ROOT  # noqa: F401  (puts the repo on sys.path)
from views.found_effects import FoundEffects, cache_key, cache_path
from views.tour import tour_steps
from views.try_this import effect_label, status_text

EFFECT = {"kind": "ablate heads", "layer": 3, "ids": "3", "message": "Copy: glass box",
          "before": "glass box", "after": "drum box", "evidence": "x", "prompt_a": "",
          "prompt_b": "", "scale": 0.0}


def test_a_cached_search_is_read_back_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSBOX_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    path = cache_path(str(ckpt), "sys", {})
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps([EFFECT]))
    store = FoundEffects("sys")
    store.start(str(ckpt))
    assert store.get(str(ckpt)) == [EFFECT]


def test_the_cache_key_follows_the_checkpoint_and_the_system_prompt(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    a = cache_key(str(tmp_path), "sys")
    assert a != cache_key(str(tmp_path), "other")
    (tmp_path / "config.json").write_text('{"changed": 1}')
    assert a != cache_key(str(tmp_path), "sys")


def test_each_effect_is_one_line_saying_what_and_the_change():
    assert effect_label(EFFECT) == ("ablate head 3 at layer 3 · 'Copy: glass box': "
                                    "'glass box' → 'drum box'")
    steer = dict(EFFECT, kind="steer", ids="", prompt_a="A", prompt_b="B", scale=2.0)
    assert effect_label(steer).startswith("steer at layer 3 ×2 along 'A' − 'B'")
    assert "Searching" in status_text(None) and "Try this" in status_text([EFFECT])


def test_the_demo_tour_sends_an_example_then_kv_layers_and_a_found_effect():
    steps = tour_steps(True, 16)
    assert [s["tab"] for s in steps] == ["chat", "kv", "layers", "chat"]
    assert steps[0]["click"].startswith("#chat-example") and steps[-1]["click"] == "#iv-try-0"
    assert "16 token slots" in steps[1]["text"]


def test_a_real_checkpoints_tour_has_no_demo_steps():
    steps = tour_steps(False, 16)
    assert [s["tab"] for s in steps] == ["chat", "kv", "layers", "chat"]
    text = json.dumps(steps)
    assert "#chat-example" not in text and "#iv-try" not in text and "demo" not in text
