"""The Engine tab's latency table counts every request the engine finishes (issue 52.4), and
its history their steps: a finish listener feeds both, so requests sent while no tab polls the
engine are not missed."""
import time
from types import SimpleNamespace

import pytest

from ui_helpers import require_engine, shared_app, wait_until  # noqa: I001
from views.engine_timeline import EngineTimeline, history_for


def final_event(rid, ttft, e2e, n_out, decode_s):
    return SimpleNamespace(request_id=rid, metrics={"ttft_s": ttft, "e2e_s": e2e,
                                                    "num_output_tokens": n_out,
                                                    "decode_s": decode_s})


def test_finished_requests_give_ttft_tpot_and_end_to_end_percentiles():
    h = EngineTimeline()
    h.finish(final_event("a", 0.1, 1.0, 11, 0.5), now=100.0)      # 50 ms per output token
    h.finish(final_event("b", None, 0.2, 0, 0.0), now=100.0)      # aborted before a token
    h.finish(final_event("c", 0.1, 1.0, 3, 0.2), now=10.0)        # outside the window
    lat = h.latency(100.0, window_s=60)
    assert lat["requests"] == 2
    assert lat["ttft"] == pytest.approx([0.1] * 3)
    assert lat["tpot"] == pytest.approx([0.05] * 3)
    assert lat["e2e"][0] == pytest.approx(0.6)


@pytest.mark.slow
def test_requests_sent_with_no_tab_open_are_all_counted():
    require_engine()
    from engine import SamplingParams
    running = shared_app()
    hist = history_for(running.hub)
    before = hist.latency(time.time())["requests"]
    tokens = sum(b.decode_tokens for b in hist.series())
    n = 6
    running.hub.llm.generate([f"Count to {i}." for i in range(n)],
                             SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    wait_until(lambda: hist.latency(time.time())["requests"] >= before + n, timeout=30)
    # and their steps are in the tokens/s history, read by no tab
    assert sum(b.decode_tokens for b in hist.series()) >= tokens + 3 * n
