"""The playground's named API `/chat`, driven with gradio_client against the app on a local port."""
import threading

import pytest

from ui_helpers import require_engine, shared_app, wait_until  # noqa: I001

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def running():
    require_engine()
    return shared_app()


@pytest.fixture(scope="module")
def client(running):
    from gradio_client import Client
    return Client(running.url, verbose=False)


def _stream(client, message, system="Be brief.", temperature=0.0, max_tokens=24,
            ignore_eos=False):
    job = client.submit(message, system, temperature, max_tokens, ignore_eos, api_name="/chat")
    return [chunk for chunk in job]


def _engine_greedy(llm, message, system, max_tokens):
    from engine import SamplingParams
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": message}]
    out = llm.generate([msgs], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    return out.text


def test_chat_endpoint_streams_the_engines_greedy_reply(running, client):
    message = "Tell me a long story about a small robot who learns to paint."
    chunks = _stream(client, message, max_tokens=24)
    assert len(chunks) >= 3, chunks                       # it streamed, not one final blob
    assert all(b.startswith(a) for a, b in zip(chunks, chunks[1:]))   # each chunk grows
    assert chunks[-1] == _engine_greedy(running.llm, message, "Be brief.", 24)


@pytest.mark.parametrize("args, says", [
    (("", "sys", 0.0, 8), "empty"),
    (("x" * 20_001, "sys", 0.0, 8), "limit"),
    (("hi", "sys", -1.0, 8), "temperature"),
    (("hi", "sys", 0.0, 0), "max tokens"),
])
def test_bad_input_is_a_clear_error_and_the_app_keeps_working(client, args, says):
    from gradio_client.exceptions import AppError
    with pytest.raises(AppError, match=says):
        client.predict(*args, api_name="/chat")
    assert client.predict("hi", "sys", 0.0, 4, api_name="/chat")


def test_prompt_longer_than_the_model_allows_is_reported(running, client):
    from gradio_client.exceptions import AppError
    long = " ".join(["word"] * 3000)          # far past the model's max_model_len
    with pytest.raises(AppError, match="max_model_len"):
        client.predict(long, "sys", 0.0, 8, api_name="/chat")


def test_concurrent_chats_batch_together_with_one_request_id_each(running):
    from gradio_client import Client
    outs: dict[int, list[str]] = {}
    clients = [Client(running.url, verbose=False) for _ in range(2)]
    start = threading.Barrier(2)

    def run(i):
        start.wait()        # submit together, so the two replies overlap in the engine
        outs[i] = _stream(clients[i], f"Count to twenty, request {i}.", temperature=0.7,
                          max_tokens=200, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(outs) == 2 and all(outs.values())
    steps = running.hub.snapshot(max_age=0).steps
    chat_ids = {e.request_id for s in steps for e in s.entries if e.request_id.startswith("chat-")}
    batched = [s for s in steps if len({e.request_id for e in s.entries}) >= 2]
    assert len(chat_ids) >= 2 and batched, "the two replies never shared an engine step"


def test_cancelling_a_streaming_call_aborts_it_in_the_engine(running, client):
    job = client.submit("Write a very long essay about caches.", "sys", 0.7, 1000, True,
                        api_name="/chat")
    wait_until(lambda: len(job.outputs()) >= 2, timeout=60)
    job.cancel()

    def freed():
        snap = running.hub.snapshot(max_age=0)
        return not any(r.startswith("chat-") for r in snap.running + list(snap.block_tables))
    wait_until(freed, timeout=20)
    assert len(job.outputs()) < 1000


def test_model_switch_swaps_the_engine_between_bundled_demos():
    require_engine()
    import app
    choices = app.demo_choices()
    if len(choices) < 2:
        pytest.skip("needs both assets/demo-qwen3 and assets/demo-qwen3-moe")
    from engine import LLM, SamplingParams
    from views.live import EngineHub
    dense, moe = list(choices)
    kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=32)
    hub = EngineHub(LLM(choices[dense], **kwargs), llm_kwargs=kwargs, choices=choices)
    try:
        assert hub.current_choice() == dense
        hub.switch(moe)
        assert hub.current_choice() == moe and "Moe" in hub.model_line()
        assert hub.snapshot(max_age=0).moe is not None
        out = hub.llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=4))
        assert len(out[0].token_ids) >= 1
        with pytest.raises(ValueError, match="unknown model"):
            hub.switch("no such model")
    finally:
        hub.llm.shutdown()


def test_switching_after_a_burst_frees_the_old_engine():
    """The app's Fire-burst then model switch, repeated: each old engine is collected (weakref),
    its burst threads end, and neither RSS nor the thread count grows cycle over cycle."""
    require_engine()
    import gc
    import weakref

    import app
    choices = app.demo_choices()
    if len(choices) < 2:
        pytest.skip("needs both assets/demo-qwen3 and assets/demo-qwen3-moe")
    from engine import LLM
    from views.kv_cache import fire_burst
    from views.live import EngineHub

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
    names = list(choices)
    kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=64)
    hub = EngineHub(LLM(choices[names[0]], **kwargs), llm_kwargs=kwargs, choices=choices)
    threads0, rss = threading.active_count(), []
    try:
        for cycle in range(4):
            fire_burst(hub, 4, max_tokens=400)
            wait_until(lambda: len(hub.llm.inspect().running) >= 2, timeout=30)
            old = weakref.ref(hub.llm)
            hub.switch(names[(cycle + 1) % 2])
            wait_until(lambda: not [t for t in threading.enumerate()
                                    if t.name.startswith("glassbox-burst")], timeout=30)
            gc.collect()
            assert old() is None, "something still holds the switched-out engine"
            rss.append(rss_mb())
    finally:
        hub.shutdown()
    assert threading.active_count() <= threads0 + 2
    assert rss[-1] - rss[1] < 80, f"RSS grew cycle over cycle: {rss} MB"


def test_the_model_line_reads_during_a_switch():
    """While a switch loads the next model, every page's sync reads the model line of the old,
    already shut-down engine (a 500 in the browser once): it must still describe it."""
    require_engine()
    import app
    from engine import LLM
    from views.live import EngineHub
    kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=32)
    llm = LLM(str(app.DEMO_DENSE) if (app.DEMO_DENSE / "config.json").exists()
              else app.resolve_model(None)[0], **kwargs)
    hub = EngineHub(llm, llm_kwargs=kwargs)
    line = hub.model_line()
    llm.shutdown()                          # what switch() does before loading the next one
    hub.switching = "the next model"
    assert hub.model_line().endswith(line) and "Loading" in hub.model_line()
