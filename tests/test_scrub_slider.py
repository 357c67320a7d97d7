"""The Layers tab's token slider passes any typed number on (issue 52.3): past either end, a
fraction or an emptied box never raises; the tab's refresh clamps it to the tokens there are."""
from ui_helpers import ROOT  # noqa: F401  (puts the repo on sys.path)
from views.scrub_slider import ScrubSlider


def test_out_of_range_fractional_and_empty_values_pass_through():
    s = ScrubSlider(0, 28, 0, step=1)
    assert s.preprocess(68) == 68 and s.preprocess(-5) == -5
    assert s.preprocess(3.7) == 3.7              # the refresh takes int() of it
    assert s.preprocess(None) is None
