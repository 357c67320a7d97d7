"""The model selector stays when --model names a bundled demo (issue 52.10), and goes for any
other checkpoint or with --no-model-switch."""
import os

import pytest

from ui_helpers import ROOT  # noqa: F401  (puts the repo on sys.path)
import app


def test_a_bundled_demo_given_by_any_path_keeps_the_selector():
    demos = app.demo_choices()
    if not demos:
        pytest.skip("no bundled demo checkpoint")
    path = next(iter(demos.values()))
    rel = os.path.relpath(path)
    model, choices = app.switch_choices(rel)
    assert choices == demos and model == path      # as the switch knows it: shown chosen


def test_no_model_flag_offers_the_demos():
    assert app.switch_choices(None) == (None, app.demo_choices())


def test_another_checkpoint_or_no_switch_hides_the_selector(tmp_path):
    assert app.switch_choices(str(tmp_path)) == (str(tmp_path), {})
    assert app.switch_choices("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", {})
    demos = app.demo_choices()
    if demos:
        assert app.switch_choices(next(iter(demos.values())), no_switch=True)[1] == {}
