"""Disaggregated serving: a prefill engine hands each request's KV pages to a decode engine.

The reference is one Engine serving the same prompts: with the same KV format on both sides the
pages move unchanged, so every token must be the same. With BF16 prefill pages and an FP8 decode
pool, the conversion must store exactly what an FP8 engine stores."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mixserve
from mixserve import faults
from mixserve import kv_transfer
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import Engine
from mixserve.kv_cache import KVFormat, init_pools, kv_format
from mixserve.kv_cache import bytes_per_token as kv_bytes_per_token
from models.presets import TINY_PRESETS
from conftest import ONE_STEP_SHAPE

PAGE = 4
# One decode row count and one prefill chunk length: fewer compiles (the shapes are tested elsewhere).
CFG = dict(page_size=PAGE, max_batch=4, prefill_chunk=8, integrity="check", **ONE_STEP_SHAPE)


def prompts(seed, lengths=(5, 11, 1, 14)):
    """Prompts that end mid-page and span several pages (page size 4), one of a single token."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in lengths]


def pair(model, prefill_kw=None, decode_kw=None, decode_model=None, **kw):
    prefill = Engine(model, prefill_only=True, **{**CFG, "num_pages": 64, **kw, **(prefill_kw or {})})
    decode = Engine(decode_model or model, **{**CFG, "num_pages": 64, **kw, **(decode_kw or {})})
    return DisaggregatedEngine(prefill, decode)


def assert_all_pages_returned(dis):
    for engine in (dis.prefill, dis.decode):
        assert engine.free_pages == engine.num_pages


@pytest.fixture(scope="module", params=["tiny-kimi", "tiny-glm4", "tiny-glm5"])
def model(request):
    return mixserve.load(request.param, dtype="float32")


def test_handover_serves_the_tokens_one_engine_serves(model):
    """Same FP8 format on both sides (calibrated-looking scales, not 1): pages move unchanged.
    Prompts end mid-page and span several prefill chunks; half the requests sample, with logprobs
    (the first token's from the prefill engine, the rest from the decode engine) and prompt
    logprobs (from the prefill engine) and penalties (the first token's read on the prefill side,
    the rest on the decode side)."""
    scales = dict(kv_dtype="fp8_e4m3", k_scale=0.05, v_scale=0.04)
    ps = prompts(1) + [[7] * 30]
    one = Engine(model, num_pages=64, **CFG, **scales)
    dis = pair(model, **scales)
    for temperature, logprobs, penalties in ((0.0, None, {}), (0.8, 3, dict(repetition_penalty=1.3, presence_penalty=0.5))):
        options = dict(temperature=temperature, seed=3, logprobs=logprobs, prompt_logprobs=logprobs, **penalties)
        want = one.generate(ps, max_new_tokens=6, **options)
        got = dis.generate(ps, max_new_tokens=6, **options)
        assert [r.status for r in got] == ["ok"] * len(ps)
        assert [r.tokens for r in got] == [r.tokens for r in want]
        for a, b in zip(got, want):
            assert (a.logprobs is None) == (a.prompt_logprobs is None) == (logprobs is None)
            if logprobs is None:
                continue
            assert a.prompt_logprobs[0] is b.prompt_logprobs[0] is None
            for x, y in zip(a.logprobs + a.prompt_logprobs[1:], b.logprobs + b.prompt_logprobs[1:], strict=True):
                assert x.rank == y.rank and [i for i, _ in x.top] == [i for i, _ in y.top]
                np.testing.assert_allclose([x.logprob, *(v for _, v in x.top)], [y.logprob, *(v for _, v in y.top)],
                                           rtol=1e-5)
    prompt_pages = sum(math.ceil(len(p) / PAGE) for p in ps)
    assert dis.counters.handovers == 2 * len(ps)
    assert dis.counters.pages_sent + dis.counters.pages_shared == 2 * prompt_pages
    assert dis.counters.bytes_sent == dis.counters.pages_sent * PAGE * dis.decode.bytes_per_token
    assert dis.prefill.counters.decode_tokens == 0  # the prefill engine never decodes
    assert dis.decode.counters.prefill_tokens == 0  # nothing was recomputed on the decode side
    assert_all_pages_returned(dis)


def _random_pools(cfg, num_pages, dtype, rng):
    pools = init_pools(cfg, num_pages, PAGE, KVFormat(jnp.dtype(jnp.float32)))
    return jax.tree.map(lambda z: jnp.asarray(rng.normal(0, 3, z.shape), jnp.float32).astype(dtype), pools)


def _fp8_reference(pages, sender_scale, receiver_scale):
    """float32 arithmetic in numpy, then a saturating cast to e4m3 (448 is its largest finite).
    A BF16 pool holds real values: scales apply to FP8 pools only."""
    real = np.asarray(pages, np.float32)
    if pages.dtype == ml_dtypes.float8_e4m3fn:
        real = real * np.asarray(sender_scale, np.float32)
    return np.clip(real / np.float32(receiver_scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("sender", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("name", ["tiny-glm4", "tiny-glm5"])
def test_export_converts_to_the_receivers_format_and_import_writes_only_its_pages(name, sender):
    """BF16 pages, or FP8 pages with one set of scales, into an FP8 pool with another (GQA: per
    KV head; GLM-5: the MLA latent and the DSA index pool). The receiving pool starts as random
    FP8 bytes, so a page written wrongly, or written where it should not be, shows."""
    cfg = mixserve.load(name, dtype="float32").config
    rng = np.random.default_rng()
    # Per layer (kv_cache.layer_scales): GQA per KV head too, MLA one scale for the latent.
    shape = (cfg.num_layers, cfg.num_kv_heads) if cfg.attention_kind == "gqa" else (cfg.num_layers,)
    src_scales, dst_scales = ((jnp.asarray(rng.uniform(low, high, shape), jnp.float32) for _ in "kv")
                              for low, high in ((0.5, 2), (0.01, 0.05)))
    src_scales, dst_scales = tuple(src_scales), tuple(dst_scales)
    src = _random_pools(cfg, 12, sender, rng)
    dst = _random_pools(cfg, 10, jnp.float8_e4m3fn, rng)
    before = jax.tree.map(np.asarray, dst)
    src_ids, dst_ids = [3, 11, 0, 7, 5], [9, 2, 4, 0, 6]
    sent = kv_transfer.export_pages(src, kv_transfer.padded(src_ids, 0), src_scales, dst_scales,
                                    dst_layout=kv_transfer.layout(dst), convert=True)
    new = kv_transfer.import_pages(dst, kv_transfer.padded(dst_ids, 10), sent)
    checked = set()
    for layer, (s_layer, b_layer, n_layer) in enumerate(zip(src, before, new)):
        for key, pool in n_layer.items():
            axis = kv_transfer.page_axis(key)
            got, old, s = (np.moveaxis(np.asarray(x), axis, 0) for x in (pool, b_layer[key], s_layer[key]))
            if key in ("k", "v"):
                i = "kv".index(key)
                shape = (1, -1, 1, 1)  # per KV head, after moving pages first: [N, KVH, S, D]
                sender, receiver = (np.asarray(x[i][layer]).reshape(shape) for x in (src_scales, dst_scales))
            else:
                sender, receiver = (np.float32(1), np.float32(1)) if key == "index" else (
                    np.asarray(src_scales[0][layer]), np.asarray(dst_scales[0][layer]))
            want = _fp8_reference(s[src_ids], sender, receiver)
            np.testing.assert_array_equal(got[dst_ids].view(np.uint8), want.view(np.uint8))
            untouched = [p for p in range(got.shape[0]) if p not in dst_ids]
            np.testing.assert_array_equal(got[untouched].view(np.uint8), old[untouched].view(np.uint8))
            checked.add(key)
    assert checked == ({"k", "v"} if cfg.attention_kind == "gqa" else {"latent", "index"})


@pytest.mark.parametrize("scales", [dict(k_scale=jnp.asarray([0.03, 0.05]), v_scale=0.02),
                                    dict(k_scale=jnp.asarray([[0.03, 0.05], [0.02, 0.04], [0.05, 0.01]]),
                                         v_scale=jnp.asarray([[0.02], [0.06], [0.01]]))],
                         ids=["per-head", "per-layer"])
def test_bf16_prefill_pages_reach_the_fp8_decode_pool_as_an_fp8_engine_stores_them(scales):
    """The seed's split: prefill keeps BF16 KV, decode FP8. With prompts of one chunk, prefill
    attends only to its fresh keys, so the FP8 pages that arrive must equal an FP8 engine's byte
    for byte (each layer under its own scales): the same tokens follow. The transfer carries FP8
    bytes, half of BF16."""
    model = mixserve.load("tiny-glm4", dtype="bfloat16")
    ps = [p[:8] for p in prompts(2)]
    want = Engine(model, num_pages=64, kv_dtype="fp8_e4m3", **CFG, **scales).generate(ps, max_new_tokens=8)
    dis = pair(model, prefill_kw=dict(kv_dtype="bfloat16"), decode_kw=dict(kv_dtype="fp8_e4m3", **scales))
    got = dis.generate(ps, max_new_tokens=8)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    bf16 = Engine(model, num_pages=1, kv_dtype="bfloat16", **CFG).bytes_per_token
    assert dis.counters.bytes_sent * 2 == dis.counters.pages_sent * PAGE * bf16
    assert_all_pages_returned(dis)


def test_a_full_decode_engine_holds_requests_on_the_prefill_side_and_loses_nothing():
    """Decode has 2 slots and 7 pages for 5 requests: the prefilled ones wait on the prefill side
    with their pages, and the decode engine preempts and recomputes when its pages run out."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    ps = prompts(4) + [[9] * 10]
    want = Engine(model, num_pages=64, **CFG).generate(ps, max_new_tokens=8)
    dis = pair(model, decode_kw=dict(max_batch=2, num_pages=7))
    for i, p in enumerate(ps):
        dis.submit(p, max_new_tokens=8)
    held, out, preempted_waiting = 0, {}, 0
    while dis.has_work():
        waiting, handovers = bool(dis.decode.scheduler.waiting), dis.counters.handovers
        for u in dis.step():
            out.setdefault(u.rid, []).extend(u.new_tokens)
            assert u.result is None or u.result.status == "ok"
        held = max(held, len(dis.prefill.scheduler.live()))
        if waiting:  # a request the decode engine preempted goes before any new one
            assert dis.counters.handovers == handovers
            preempted_waiting += 1
    assert [out[i] for i in range(len(ps))] == [r.tokens for r in want]
    assert held >= 1  # a prefilled request waited for the decode side
    assert preempted_waiting >= 1
    assert dis.decode.counters.preemptions >= 1 and dis.decode.counters.prefill_tokens > 0
    assert_all_pages_returned(dis)


def test_cancel_frees_a_request_held_on_the_prefill_side_and_one_decoding_on_the_decode_side():
    model = mixserve.load("tiny-kimi", dtype="float32")
    ps = prompts(5)
    dis = pair(model, decode_kw=dict(max_batch=1))
    decoding, held = dis.submit(ps[0], max_new_tokens=8), dis.submit(ps[1], max_new_tokens=8)
    results = {}
    while not dis.prefill.scheduler.live():  # prefilled, waiting for the decode side's one slot
        results.update({u.rid: u.result for u in dis.step() if u.result is not None})
    assert [r.rid for r in dis.decode.scheduler.live()] == [decoding]
    assert [r.rid for r in dis.prefill.scheduler.live()] == [held]
    assert dis.cancel(held) and dis.prefill.free_pages == dis.prefill.num_pages
    assert dis.cancel(decoding) and dis.decode.free_pages == dis.decode.num_pages
    while dis.has_work():
        results.update({u.rid: u.result for u in dis.step() if u.result is not None})
    assert {rid: (r.status, r.reason) for rid, r in results.items()} == {
        decoding: ("aborted", "cancelled"), held: ("aborted", "cancelled")}
    want = Engine(model, num_pages=64, **CFG).generate(ps[2:3], max_new_tokens=8)[0].tokens
    assert dis.generate(ps[2:3], max_new_tokens=8)[0].tokens == want  # the pair goes on serving
    assert_all_pages_returned(dis)


def test_the_decode_pool_shares_a_prompt_prefix_it_already_holds_instead_of_receiving_it():
    model = mixserve.load("tiny-kimi", dtype="float32")
    system = [int(t) for t in np.random.default_rng(5).integers(0, 256, 12)]  # 3 full pages
    ps = [system + [1, 2, 3], system + [4, 5]]
    want = Engine(model, num_pages=64, **CFG).generate(ps, max_new_tokens=5)
    dis = pair(model)
    got = dis.generate(ps, max_new_tokens=5)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert dis.counters.pages_shared == 3
    assert dis.counters.pages_sent == 4 + 4 - 3  # 15 and 14 tokens: 4 pages each
    assert_all_pages_returned(dis)


def test_handed_over_pages_are_checked_on_the_decode_side():
    """A bookkeeping fault in the decode engine's table after the handover aborts that request
    only, with the reason; the other finishes with the tokens of one engine."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    ps = prompts(6)[:2]
    want = Engine(model, num_pages=64, **CFG).generate(ps, max_new_tokens=6)
    hook = lambda table, step: faults.stale_tag(table, 1) if step == 2 else table
    dis = pair(model, decode_kw=dict(fault_hook=hook))
    got = dis.generate(ps, max_new_tokens=6)
    assert got[0].status == "ok" and got[0].tokens == want[0].tokens
    assert got[1].status == "aborted" and "tag" in got[1].reason
    assert got[1].tokens == want[1].tokens[: len(got[1].tokens)]


@pytest.mark.parametrize("integrity", ["check", "strict"])
def test_a_corrupt_mapping_on_the_prefill_side_is_caught_before_its_pages_are_sent(integrity):
    """Right after the second request's prefill, a bookkeeping bug re-tags one of its pages on
    the prefill side. Its hand-over would send whatever that page now holds; instead it is
    aborted with the reason (strict: then raised), and the other request is served as one engine."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    ps = prompts(7)[:2]  # 5 and 11 tokens: prefilled in steps 1 and 2
    want = Engine(model, num_pages=64, **CFG).generate(ps, max_new_tokens=6)
    dis = pair(model, integrity=integrity)
    advance, corrupted = dis.prefill._advance, []

    def advance_then_corrupt():
        advance()
        for r in dis.prefill.scheduler.live():
            if r.rid == 1 and not corrupted:
                dis.prefill.page_manager.table = faults.stale_tag(dis.prefill.page_manager.table, r.slot)
                corrupted.append(r.rid)

    dis.prefill._advance = advance_then_corrupt
    rids, results, raised = [dis.submit(p, max_new_tokens=6) for p in ps], {}, []
    for _ in range(50):  # strict: the step raises once the request is aborted, and the pair goes on
        if not dis.has_work():
            break
        try:
            results.update({u.rid: u.result for u in dis.step() if u.result is not None})
        except RuntimeError as err:
            raised.append(str(err))
    assert not dis.has_work()
    got = [results[r] for r in rids]
    assert len(raised) == (integrity == "strict")
    assert all(m.startswith("KV integrity check failed before hand-over: page ") for m in raised)
    assert corrupted == [1]
    assert got[0].status == "ok" and got[0].tokens == want[0].tokens
    assert got[1].status == "aborted" and got[1].tokens == want[1].tokens[:1]  # its first token came from prefill
    assert got[1].reason.startswith("KV integrity check failed before hand-over: page ")
    assert dis.counters.handovers == 1 and dis.prefill.counters.aborts == 1
    # The re-tagged page no longer matches the request's record, so release leaves it out of
    # circulation (page_table.release: a corrupt mapping never frees a page); the rest return.
    assert dis.prefill.free_pages == dis.prefill.num_pages - 1
    assert dis.decode.free_pages == dis.decode.num_pages


def test_a_request_the_leaky_decode_pool_can_never_take_is_aborted_not_held():
    """A swapped mapping on the decode side aborts its two requests and leaks 6 of its 8 pages
    (release keeps a corrupt mapping's pages out of circulation). A third request needs 3: with
    nothing running there to free any, it is aborted with the reason, as one engine aborts it,
    instead of waiting on the prefill side forever; the prefill side gets its pages back."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    swap = lambda table, step: faults.inject(table, "swapped_mapping", slot=jnp.int32(0), other=jnp.int32(1)) \
        if step == 0 else table
    dis = pair(model, decode_kw=dict(num_pages=8, fault_hook=swap))
    first = dis.generate(prompts(6, (11, 11)), max_new_tokens=5)
    assert [r.status for r in first] == ["aborted", "aborted"] and dis.decode.free_pages == 2
    rid, results = dis.submit(prompts(7, (9,))[0], max_new_tokens=3), {}
    for _ in range(20):
        if not dis.has_work():
            break
        results.update({u.rid: u.result for u in dis.step() if u.result is not None})
    assert not dis.has_work() and results[rid].status == "aborted"
    assert results[rid].reason == ("decode engine: KV pool exhausted: 2 free pages, 3 needed (pages leaked after a "
                                   "detected bookkeeping fault)")
    assert dis.prefill.free_pages == dis.prefill.num_pages


def test_bad_pairs_raise_and_a_request_too_long_for_one_side_is_rejected_with_its_name():
    model = mixserve.load("tiny-kimi", dtype="float32")
    other = mixserve.load("tiny-glm4", dtype="float32")
    p = lambda **kw: Engine(model, prefill_only=True, **{**CFG, "num_pages": 8, **kw})
    d = lambda m=model, **kw: Engine(m, **{**CFG, "num_pages": 8, **kw})
    with pytest.raises(ValueError, match="prefill_only"):
        DisaggregatedEngine(d(), d())
    with pytest.raises(RuntimeError, match="never decodes"):  # alone it would loop forever
        p().generate([[1, 2]], max_new_tokens=2)
    with pytest.raises(ValueError, match="same model"):
        DisaggregatedEngine(p(), d(other))
    with pytest.raises(ValueError, match="page sizes"):
        DisaggregatedEngine(p(), d(page_size=8))
    with pytest.raises(ValueError, match=r"same tokens, got \(2,\) and \(2, 7\)"):  # the first token would stop on (2,) only
        DisaggregatedEngine(p(stop_tokens=(2,)), d(stop_tokens=(2, 7)))
    # The prefill engine holds only prompts: 3 pages (12 tokens) and a context of 12 suffice for a
    # 12-token prompt with 6 new tokens. The decode engine's context limit of 16 does not.
    dis = DisaggregatedEngine(p(num_pages=3, max_seq_len=12), d(max_seq_len=16))
    got = dis.generate([[1] * 9, [2] * 12, [3] * 13], max_new_tokens=6)
    assert got[0].status == "ok" and len(got[0].tokens) == 6
    assert got[1].status == "rejected" and got[1].reason == (
        "decode engine: prompt (12) + max_new_tokens (6) = 18 exceeds the context limit 16")
    assert got[2].status == "rejected" and got[2].reason == "prefill engine: prompt (13) exceeds the context limit 12"
    assert dis.counters.rejections == 2


def _random_tiled_or_plain(cfg, fmt, num_pages, rng):
    """Pools of `fmt` holding random stored values (tiled: random e4m3, power-of-two scales, bf16 rope)."""
    def fill(name, z):
        if name.endswith("_scale"):
            return jnp.asarray(2.0 ** rng.integers(-12, 4, z.shape), jnp.float32)
        return jnp.asarray(rng.normal(0, 3, z.shape), jnp.float32).astype(z.dtype)
    return [{name: fill(name, z) for name, z in layer.items()} for layer in init_pools(cfg, num_pages, PAGE, fmt)]


@pytest.mark.parametrize("sender", ["bfloat16", "fp8_e4m3", "fp8_ds_mla"])
def test_export_into_the_tiled_layout_is_the_format_bit_for_bit(sender):
    """GLM-5 pages into an fp8_ds_mla pool: latent nope values and DSA index keys with a power-of-two
    scale per token and tile, the RoPE part in bf16, byte for byte as numpy computes the format from
    the sender's real values (test_kernels_tiled_fp8._quantize_float64). A tiled sender's pages are
    copied. The receiving pools start random, so a misplaced or missing write shows."""
    from test_kernels_tiled_fp8 import _quantize_float64

    # Latents of 256 + 8 (two tiles per token): the tiny preset's 32 would be one.
    cfg = TINY_PRESETS["tiny-glm5"].replace(kv_lora_rank=256)
    rng = np.random.default_rng()
    src_fmt, dst_fmt = kv_format(sender, jnp.float32), kv_format("fp8_ds_mla", jnp.float32)
    src, dst = _random_tiled_or_plain(cfg, src_fmt, 12, rng), _random_tiled_or_plain(cfg, dst_fmt, 10, rng)
    src_scales, dst_scales = ((jnp.full((cfg.num_layers,), value, jnp.float32),) * 2 for value in (1.5, 0.02))
    before = jax.tree.map(np.asarray, dst)
    src_ids, dst_ids = [3, 11, 0, 7, 5], [9, 2, 4, 0, 6]
    convert = kv_transfer.needs_conversion(src_fmt, src_scales, dst_fmt, dst_scales)
    assert convert == (sender != "fp8_ds_mla")
    sent = kv_transfer.export_pages(src, kv_transfer.padded(src_ids, 0), src_scales, dst_scales,
                                    dst_layout=kv_transfer.layout(dst), convert=convert)
    new = kv_transfer.import_pages(dst, kv_transfer.padded(dst_ids, 10), sent)
    L = cfg.kv_lora_rank
    for s_layer, b_layer, n_layer in zip(src, before, new):
        got = {k: np.asarray(v) for k, v in n_layer.items()}
        s = {k: np.asarray(v)[src_ids] for k, v in s_layer.items()}
        if sender == "fp8_ds_mla":
            want = s
        else:
            scale = 1.5 if sender == "fp8_e4m3" else 1.0
            real = {k: np.asarray(v, np.float64) * (scale if k == "latent" else 1.0) for k, v in s.items()}
            nope, nope_scale = _quantize_float64(real["latent"][..., :L], min(128, L))
            want = {"latent": nope, "latent_scale": nope_scale, "rope": real["latent"][..., L:].astype(ml_dtypes.bfloat16)}
            if "index" in real:
                want["index"], want["index_scale"] = _quantize_float64(real["index"], cfg.index_head_dim)
        assert set(want) == set(got)
        for key in got:
            np.testing.assert_array_equal(got[key][dst_ids].view(np.uint8),
                                          np.asarray(want[key], got[key].dtype).view(np.uint8), err_msg=key)
            untouched = [p for p in range(10) if p not in dst_ids]
            np.testing.assert_array_equal(got[key][untouched].view(np.uint8), b_layer[key][untouched].view(np.uint8))


def test_bf16_prefill_pages_reach_a_tiled_decode_pool_as_a_tiled_engine_stores_them():
    """The seed's split with FlashMLA's layout on the decode side (GLM-5: latent and index keys):
    one-chunk prompts give one fp8_ds_mla engine's tokens, and the transfer carries the tiled bytes."""
    model = mixserve.load("tiny-glm5", dtype="bfloat16")
    ps = [p[:8] for p in prompts(2)]
    want = Engine(model, num_pages=64, kv_dtype="fp8_ds_mla", **CFG).generate(ps, max_new_tokens=8)
    dis = pair(model, prefill_kw=dict(kv_dtype="bfloat16"), decode_kw=dict(kv_dtype="fp8_ds_mla"))
    got = dis.generate(ps, max_new_tokens=8)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    tiled = kv_bytes_per_token(model.config, kv_format("fp8_ds_mla", None))
    assert dis.counters.pages_sent > 0 and dis.counters.bytes_sent == dis.counters.pages_sent * PAGE * tiled
    assert_all_pages_returned(dis)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_prefilled_requests_reach_a_one_slot_decode_engine_in_priority_order(policy):
    """A decode engine of one slot decodes X while L (priority 2) and then H (priority 1) are
    prefilled and wait on the prefill side: under "priority" H is handed over first, under fcfs
    (all 0) L; the tokens are one engine's either way."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    ps = prompts(8, lengths=(5, 6, 7))
    want = Engine(model, num_pages=64, **CFG).generate(ps, max_new_tokens=8)
    dis = pair(model, decode_kw=dict(max_batch=1), schedule_policy=policy)
    level = (lambda pr: pr) if policy == "priority" else (lambda pr: 0)
    finished, out, rids = [], {}, []
    for p, pr in zip(ps, (0, 2, 1)):  # X, then L a step later, then H
        rids.append(dis.submit(p, max_new_tokens=8, priority=level(pr)))
        for u in dis.step():
            out.setdefault(u.rid, []).extend(u.new_tokens)
    assert dis.decode.scheduler.running[0].rid == rids[0] and len(dis.prefill.scheduler.live()) == 2
    while dis.has_work():
        for u in dis.step():
            out.setdefault(u.rid, []).extend(u.new_tokens)
            finished += [u.rid] if u.result is not None else []
    assert finished == ([rids[0], rids[2], rids[1]] if policy == "priority" else rids)
    assert [out[r] for r in rids] == [r.tokens for r in want]
    assert_all_pages_returned(dis)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_preempted_request_waiting_on_the_decode_side_goes_first_only_by_its_priority(policy):
    """The decode side's waiting (preempted) request of priority 5 holds back a hand-over under
    fcfs, but not one of priority 0 under "priority"; one of priority 7 waits behind it there too."""
    from mixserve.request import Request
    model = mixserve.load("tiny-glm4", dtype="float32")
    decode = Engine(model, num_pages=64, **{**CFG, "schedule_policy": policy})
    preempted = Request(10, [1, 2, 3], 2, 0.0, 1.0, 0, priority=5)
    preempted.cache_hit_tokens = 0
    decode.scheduler.waiting.append(preempted)
    for rid, priority, taken in ((11, 0, policy == "priority"), (12, 7, False)):
        req = Request(rid, [4, 5, 6, 7, 8], 2, 0.0, 1.0, 0, priority=priority)
        req.cached = 5  # prefilled elsewhere
        assert (decode.scheduler.adopt(req) is not None) == taken, (rid, policy)
