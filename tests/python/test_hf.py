"""sparseattn.hf: a transformers Llama whose attention layers are NSA, on the CPU (float64, tiny random models)."""
import pytest
import torch

from helpers import require_sparseattn

require_sparseattn()
transformers = pytest.importorskip("transformers", reason="the transformers integration needs transformers")
import sparseattn  # noqa: E402
from sparseattn import hf  # noqa: E402
from hf_models import greedy_reference, tiny_model  # noqa: E402


def test_every_attention_layer_is_nsa_and_trains():
    model = tiny_model().train()
    assert all(isinstance(layer.self_attn, hf.NSAAttention) for layer in model.model.layers)
    ids = torch.randint(0, 48, (2, 21))
    loss = model(ids, labels=ids).loss
    loss.backward()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj"):
        grad = getattr(model.model.layers[0].self_attn, name).weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_a_few_training_steps_lower_the_loss():
    model = tiny_model(seed=1).float().train()
    pattern = torch.arange(24).remainder(6)[None].repeat(4, 1) + 1  # a periodic sequence to memorise
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(pattern, labels=pattern).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model(seed=2)
    model.save_pretrained(tmp_path)
    loaded = hf.NSALlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float64).eval()
    assert loaded.config.nsa_window == 12
    ids = torch.randint(0, 48, (1, 17))
    torch.testing.assert_close(loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


def test_cache_layer_grows_and_crops():
    cache = hf.SparseAttnCache()
    chunks = [torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (5, 1, 300, 2)]
    for chunk in chunks:
        keys, values = cache.update(chunk, -chunk, 0)
    expected = torch.cat(chunks, dim=2)
    torch.testing.assert_close(keys, expected, rtol=0, atol=0)
    torch.testing.assert_close(values, -expected, rtol=0, atol=0)
    assert cache.get_seq_length() == 308
    cache.crop(-8)
    assert cache.get_seq_length() == 300
    torch.testing.assert_close(cache.layers[0].keys, expected[:, :, :300], rtol=0, atol=0)
    cache.batch_select_indices(torch.tensor([1]))
    torch.testing.assert_close(cache.layers[0].keys, expected[1:, :, :300], rtol=0, atol=0)
    with pytest.raises(hf.SparseAttnError, match="batch"):
        cache.update(torch.randn(2, 3, 1, 8, dtype=torch.float64), torch.randn(2, 3, 1, 8, dtype=torch.float64), 0)


@pytest.mark.parametrize("cache", ["sparseattn", "dynamic"])
def test_greedy_generate_equals_rerunning_the_full_forward(cache):
    model = tiny_model(seed=3)
    ids = torch.randint(1, 48, (2, 19))
    sequence = ids
    for _ in range(21):  # past several compression, selection and window boundaries
        next_token = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
    extra = {"past_key_values": hf.SparseAttnCache()} if cache == "sparseattn" else {}
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=21, do_sample=False,
                               **extra)
    assert torch.equal(generated, sequence)


def test_a_chunked_prefill_gives_the_rows_of_the_full_forward():
    model = tiny_model(seed=4)
    ids = torch.randint(1, 48, (1, 37))
    full = model(ids, use_cache=False).logits
    cache = hf.SparseAttnCache()
    parts = [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in ((0, 16), (16, 29), (29, 37))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-9, atol=1e-9)


def test_the_example_runs(capsys):
    import runpy
    import sys
    path = __file__.rsplit("/tests/", 1)[0] + "/examples/nsa_transformers.py"
    argv = sys.argv
    sys.argv = [path, "--steps", "2", "--length", "64", "--new-tokens", "4"]
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = argv
    assert "generated tokens continue the pattern" in capsys.readouterr().out


def test_cache_keeps_the_compressed_rows_of_complete_blocks():
    cache = hf.SparseAttnCache()
    chunks = [torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (5, 1, 30, 2, 7)]
    kwargs = {"cmp_block": 8, "cmp_stride": 4}
    for chunk in chunks:
        cache.update(chunk, 2 * chunk, 0, kwargs)
        layer = cache.layers[0]
        k_cmp, v_cmp = layer.compressed()
        keys = layer.keys.transpose(1, 2)
        expected_k, expected_v = sparseattn.compress_kv(keys, 2 * keys, block=8, stride=4)
        torch.testing.assert_close(k_cmp, expected_k, rtol=0, atol=0)
        torch.testing.assert_close(v_cmp, expected_v, rtol=0, atol=0)
    cache.crop(-6)  # 45 -> 39 tokens: rows of blocks past the new end go
    assert cache.layers[0].compressed()[0].shape[1] == (39 - 8) // 4 + 1


def test_decode_steps_pool_only_their_new_blocks(monkeypatch):
    model = tiny_model(seed=5)
    ids = torch.randint(1, 48, (1, 30))
    pooled = []
    real = hf.compress_kv

    def counting(k, v, **kwargs):
        pooled.append(k.shape[1])
        return real(k, v, **kwargs)

    monkeypatch.setattr(hf, "compress_kv", counting)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                   past_key_values=hf.SparseAttnCache())
    assert pooled and max(pooled[2:]) <= 8  # after the prefill (one call per layer), a block's 8 tokens at most


def test_decode_steps_run_nsa_decode_over_the_cache_pages(monkeypatch):
    """Each step of 1 new token runs sparseattn.nsa_decode over the cache's buffer seen as pages (the prefill runs
    nsa_attention); the tokens equal the full forward's."""
    model = tiny_model(seed=6)
    ids = torch.randint(1, 48, (2, 25))
    calls = []
    real = hf.nsa_decode

    def recording(q, k_pages, v_pages, **kwargs):
        calls.append((q.shape[1], k_pages.shape[1], int(kwargs["cache_seqlens"][0]), kwargs["block_table"].shape))
        return real(q, k_pages, v_pages, **kwargs)

    monkeypatch.setattr(hf, "nsa_decode", recording)
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False,
                               past_key_values=hf.SparseAttnCache())
    assert torch.equal(generated, greedy_reference(model, ids, 9))
    layers = model.config.num_hidden_layers
    assert len(calls) == 8 * layers  # the 8 steps after the prefill, every layer
    assert all(tq == 1 and page == hf.DECODE_PAGE_SIZE for tq, page, _, _ in calls)
    assert [length for _, _, length, _ in calls[::layers]] == list(range(26, 34))
    assert all(layer.self_attn.decode_unsupported is None for layer in model.model.layers)


def test_a_layer_that_nsa_decode_refuses_falls_back_to_nsa_attention(monkeypatch):
    model = tiny_model(seed=7)
    ids = torch.randint(1, 48, (1, 20))

    def refusing(*args, **kwargs):
        raise hf.SparseAttnUnsupportedError("sparseattn.nsa_decode: argument 'q': not taken here")

    monkeypatch.setattr(hf, "nsa_decode", refusing)
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                               past_key_values=hf.SparseAttnCache())
    assert torch.equal(generated, greedy_reference(model, ids, 6))
    assert all("not taken here" in layer.self_attn.decode_unsupported for layer in model.model.layers)


def test_a_cache_buffer_that_is_not_whole_pages_is_refused_before_decoding():
    cache = hf.SparseAttnCache()
    cache.update(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), 0, {"cmp_block": 8, "cmp_stride": 4})
    layer = cache.layers[0]
    assert layer._keys.shape[1] % hf.DECODE_PAGE_SIZE == 0
    layer._keys = layer._keys[:, :100]  # as a caller's own buffer might be
    g = torch.rand(1, 1, 4)
    with pytest.raises(hf.SparseAttnUnsupportedError, match="whole contiguous pages"):
        layer.nsa_decode(torch.randn(1, 1, 4, 8), g, g, g, sparseattn.NSAConfig(cmp_block=8, cmp_stride=4,
                                                                               sel_block=8, num_selected=2,
                                                                               num_local=1, window=8))


def test_beam_search_reorders_the_cache_buffers():
    """transformers' beam search reorders the cache at every step: the SparseAttnCache's buffers and compressed rows
    follow (not just its views), so the beams equal those of transformers' DynamicCache."""
    model = tiny_model(seed=11)
    ids = torch.randint(1, 48, (2, 19))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, num_beams=3)
    assert torch.equal(model.generate(ids, past_key_values=hf.SparseAttnCache(), **kwargs),
                       model.generate(ids, **kwargs))
