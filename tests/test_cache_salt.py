"""vLLM's cache_salt: requests salted differently never share prefix-cache blocks (so a faster
first token cannot reveal that someone else sent the same prompt); equal salts share as plain
requests do, and the salt never changes what is generated. engine/cache_salt.py."""
from __future__ import annotations

import random

import pytest

from engine import LLM, InvalidArgumentError, SamplingParams
from engine.cache_salt import MAX_SALT_CHARS, chain_root

BS = 4


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    with LLM(qwen3_dir, device="cpu", block_size=BS, num_kv_blocks=128) as e:
        yield e


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 200) for _ in range(5 * BS + 2)]     # 5 full blocks to share


def _run(llm, ids, salt=None):
    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=4), cache_salt=salt)[0]


def test_salts_partition_the_prefix_cache_and_never_change_the_output(llm):
    ids = _prompt(1)
    plain = _run(llm, ids)
    assert plain.metrics["prefix_cached_blocks"] == 0
    assert _run(llm, ids).metrics["prefix_cached_blocks"] == 5         # plain shares with plain
    a = _run(llm, ids, "tenant-a")
    assert a.metrics["prefix_cached_blocks"] == 0                      # not the plain blocks
    assert _run(llm, ids, "tenant-a").metrics["prefix_cached_blocks"] == 5   # its own salt: yes
    b = _run(llm, ids, "tenant-b")
    assert b.metrics["prefix_cached_blocks"] == 0
    assert plain.token_ids == a.token_ids == b.token_ids
    assert _run(llm, ids).metrics["prefix_cached_blocks"] == 5         # plain still there
    with llm.loop.lock:
        llm.block_manager.check_invariants([])


def test_a_salt_on_stream_and_submit_too(llm):
    ids = _prompt(2)
    _run(llm, ids, "s")
    last = None
    for ev in llm.stream(ids, SamplingParams(temperature=0, max_tokens=2), cache_salt="s"):
        last = ev
    assert last.metrics["prefix_cached_blocks"] == 5
    req = llm.process(ids, SamplingParams(max_tokens=1), cache_salt="other")
    assert req.cache_root == chain_root(None, "other") != chain_root(None, "s")


def test_the_salt_combines_with_the_interventions_root():
    assert chain_root(None, None) is None and chain_root(7, None) == 7
    roots = {chain_root(None, "a"), chain_root(7, "a"), chain_root(8, "a"), chain_root(7, "b")}
    assert len(roots) == 4 and all(0 <= r < 2 ** 63 for r in roots)
    assert chain_root(7, "a") == chain_root(7, "a")        # stable: the same in every process


@pytest.mark.parametrize("salt", ["", 5, b"x", "x" * (MAX_SALT_CHARS + 1)])
def test_a_bad_salt_is_refused_naming_it(llm, salt):
    with pytest.raises(InvalidArgumentError) as e:
        llm.generate(["hi"], SamplingParams(max_tokens=1), cache_salt=salt)
    assert e.value.param == "cache_salt"


def test_a_salted_intervened_request_edits_as_an_unsalted_one_and_shares_with_neither(llm):
    """The salt and an intervention's own chain root combine: the edit runs exactly as without
    the salt, and the salted request reuses neither the plain nor the unsalted edited blocks."""
    from engine import Intervention
    ids = _prompt(3)
    iv = [Intervention.ablate_heads(0, [0, 1])]
    params = SamplingParams(temperature=0, max_tokens=6)
    plain = llm.generate([ids], params)[0]
    edited = llm.generate([ids], params, interventions=iv)[0]
    salted = llm.generate([ids], params, interventions=iv, cache_salt="t")[0]
    assert salted.token_ids == edited.token_ids
    assert salted.metrics["prefix_cached_blocks"] == 0
    both = llm.generate([ids, ids], params, interventions=[iv, iv], cache_salt="t")
    assert [o.token_ids for o in both] == [edited.token_ids] * 2      # same edits, one batch
    assert plain.metrics["prefix_cached_blocks"] == 0


def _cached_blocks(llm) -> list[int]:
    """Blocks free but holding a cached prefix (an ended request's)."""
    return [b.block_id for b in llm.inspect().blocks if b.evictable]


def test_a_salted_requests_blocks_show_their_text_only_to_its_own_salt(llm):
    """#48.9: the KV tab's hover and drilldown read BlockInfo; a block written by a salted
    request (ended: free but cached) shows counts to anyone else, never its tokens or hash."""
    from views.figures_kv import block_detail
    secret = _prompt(random.randrange(1 << 30))
    before = set(_cached_blocks(llm))
    _run(llm, secret, "tenant-secret")
    mine = [b for b in _cached_blocks(llm) if b not in before]
    assert len(mine) >= 5
    for b in mine:
        other = llm.block_info(b)
        assert other.hidden and other.token_ids == [] and other.prefix_hash is None
        assert other.num_filled == BS and other.evictable          # counts still show
        assert llm.block_info(b, viewer_salt="tenant-other").hidden
        own = llm.block_info(b, viewer_salt="tenant-secret")
        # its own text (the last block also holds reply tokens)
        assert not own.hidden and len(own.token_ids) == BS and set(own.token_ids) & set(secret)
        card = block_detail(other, BS, lambda ids: "".join(f"<{t}>" for t in ids))
        assert "private request" in card and "“" not in card and "hash" not in card
    # an unsalted request's blocks keep their text for everyone
    plain = _prompt(random.randrange(1 << 30))
    before = set(_cached_blocks(llm))
    _run(llm, plain)
    for b in [b for b in _cached_blocks(llm) if b not in before]:
        info = llm.block_info(b)
        assert not info.hidden and len(info.token_ids) == BS and set(info.token_ids) & set(plain)
