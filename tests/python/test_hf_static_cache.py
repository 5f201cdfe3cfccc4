"""sparseattn.hf.SparseAttnStaticCache on the CPU (float64, tiny random models): the fixed-capacity cache whose decode
steps transformers can compile and capture as a CUDA graph. Greedy generate() equals the SparseAttnCache path and
the full forward; the compressed rows pooled on the device equal compress_kv; a decode step traces as one graph
that every step reuses (torch.compile with a recording backend: the CPU stand-in for the CUDA graph)."""
import pytest
import torch

from helpers import require_sparseattn

require_sparseattn()
transformers = pytest.importorskip("transformers", reason="the transformers integration needs transformers")
import sparseattn  # noqa: E402
from sparseattn import hf  # noqa: E402
from hf_models import greedy_reference, recording_compile_config, tiny_config, tiny_model  # noqa: E402


def static_cache(model, batch, length):
    return hf.SparseAttnStaticCache(model.config, max_batch_size=batch, max_cache_len=length, device="cpu",
                                    dtype=torch.float64)


@pytest.mark.parametrize("prompt", [5, 19, 30])
def test_greedy_generate_equals_the_sparseattn_cache_and_the_full_forward(prompt):
    """Prompts of 5 (a prefill through the device step), 19 and 30 tokens (eager prefills), 21 new tokens: past
    several compression, selection and window boundaries."""
    model = tiny_model(seed=3)
    ids = torch.randint(1, 48, (2, prompt))
    new_tokens = 21
    expected = greedy_reference(model, ids, new_tokens)
    dynamic = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             past_key_values=hf.SparseAttnCache())
    cache = static_cache(model, 2, prompt + new_tokens)
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                               past_key_values=cache)
    assert torch.equal(dynamic, expected)
    assert torch.equal(generated, expected)
    assert int(cache.get_seq_length()) == prompt + new_tokens - 1 == cache.layers[0].host_length


def test_the_compressed_rows_equal_compress_kv_after_each_update():
    cfg = tiny_config()
    cache = hf.SparseAttnStaticCache(cfg, max_batch_size=2, max_cache_len=120, device="cpu", dtype=torch.float64)
    written = []
    for tokens in (5, 1, 1, 3, 30, 1, 16, 2, 7, 1, 1, 1, 20, 9):  # device steps (<= 16) and eager chunks
        k = torch.randn(2, 2, tokens, 16, dtype=torch.float64)
        cache.update(k, 3 * k + 1, 1)
        written.append(k)
        layer = cache.layers[1]
        keys = torch.cat(written, dim=2).transpose(1, 2)
        length = keys.shape[1]
        assert layer.lengths.tolist() == [length, length] and layer.host_length == length
        torch.testing.assert_close(layer._keys[:, :length], keys, rtol=0, atol=0)
        torch.testing.assert_close(layer._values[:, :length], 3 * keys + 1, rtol=0, atol=0)
        k_cmp, v_cmp = layer.compressed()
        expected_k, expected_v = sparseattn.compress_kv(keys, 3 * keys + 1, block=8, stride=4)
        assert k_cmp.shape == expected_k.shape
        torch.testing.assert_close(k_cmp, expected_k, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(v_cmp, expected_v, rtol=1e-14, atol=1e-14)
    assert torch.count_nonzero(cache.layers[0]._keys) == 0  # another layer's buffers are untouched


def test_a_capacity_overflow_raises_before_anything_is_written():
    model = tiny_model(seed=4)
    cache = static_cache(model, 1, 60)  # 64 tokens: whole pages
    assert cache.get_max_length() == 64
    layer = cache.layers[0]
    cache.update(torch.randn(1, 2, 60, 16, dtype=torch.float64), torch.randn(1, 2, 60, 16, dtype=torch.float64), 0)
    with pytest.raises(hf.SparseAttnError, match=r"sparseattn\.SparseAttnStaticCache.*exceed the capacity of 64"):
        cache.update(torch.randn(1, 2, 5, 16, dtype=torch.float64), torch.randn(1, 2, 5, 16, dtype=torch.float64), 0)
    with pytest.raises(hf.SparseAttnError, match="exceed the capacity"):
        cache.update(torch.randn(1, 2, 20, 16, dtype=torch.float64), torch.randn(1, 2, 20, 16, dtype=torch.float64),
                     0)
    assert layer.lengths.tolist() == [60] and layer.host_length == 60
    with pytest.raises(hf.SparseAttnError, match="exceed the capacity"):
        cache.reserve(5)
    assert all(lay.host_length == (60 if lay is layer else 0) for lay in cache.layers)
    ids = torch.randint(1, 48, (1, 40))
    with pytest.raises(hf.SparseAttnError, match="exceed the capacity"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                       past_key_values=static_cache(model, 1, 64))


def test_decode_steps_call_nsa_decode_with_the_same_device_tensors(monkeypatch):
    """Every step passes the same buffers, block table and device lengths to nsa_decode (what one captured graph
    replays); the lengths it sees are the sequence's."""
    model = tiny_model(seed=6)
    ids = torch.randint(1, 48, (2, 25))
    calls = []
    real = hf.nsa_decode

    def recording(q, k_pages, v_pages, **kwargs):
        calls.append((q.shape[1], k_pages.data_ptr(), kwargs["block_table"], kwargs["cache_seqlens"],
                      kwargs["k_cmp"].data_ptr(), kwargs["cache_seqlens"].tolist()))
        return real(q, k_pages, v_pages, **kwargs)

    monkeypatch.setattr(hf, "nsa_decode", recording)
    cache = static_cache(model, 2, 40)
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False,
                               past_key_values=cache)
    assert torch.equal(generated, greedy_reference(model, ids, 9))
    layers = model.config.num_hidden_layers
    assert len(calls) == 8 * layers and all(call[0] == 1 for call in calls)
    for index in range(layers):
        mine = calls[index::layers]
        layer = cache.layers[index]
        assert all(c[2] is layer._block_table and c[3] is layer.lengths for c in mine)
        assert len({c[1] for c in mine}) == 1 and len({c[4] for c in mine}) == 1
        assert [c[5] for c in mine] == [[n, n] for n in range(26, 34)]


def test_a_decode_step_compiles_to_one_full_graph_reused_by_every_step():
    """transformers' compile path (generate() with a compile_config) on the CPU, with a backend that records the
    graphs: one graph without breaks (fullgraph) serves every decode step, and the tokens equal the full forward's."""
    model = tiny_model(seed=8)
    compile_config, graphs = recording_compile_config()
    ids = torch.randint(1, 48, (2, 19))
    cache = static_cache(model, 2, 40)
    torch._dynamo.reset()
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               past_key_values=cache, compile_config=compile_config)
    assert torch.equal(generated, greedy_reference(model, ids, 12))
    assert len(graphs) == 1
    assert int(cache.get_seq_length()) == 30 and all(layer.host_length == 30 for layer in cache.layers)
    ops = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert any("nsa_decode" in op for op in ops), ops
    with pytest.raises(hf.SparseAttnError, match="exceed the capacity"):  # the compiled call reserves first
        cache.reset()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=50, do_sample=False,
                       past_key_values=cache, compile_config=compile_config)
    torch._dynamo.reset()


def test_cuda_shapes_the_decode_kernels_refuse_are_refused_when_the_cache_is_built():
    """Decided from the config alone, before any allocation (so this runs without a GPU)."""
    cases = [(dict(num_attention_heads=32, num_key_value_heads=1, hidden_size=2048), torch.bfloat16, "at most 16"),
             (dict(), torch.bfloat16, "head_dim 16"),
             (dict(hidden_size=256), torch.float32, "bfloat16 and float16"),
             (dict(hidden_size=256, nsa_sel_block=24, nsa_cmp_block=8, nsa_cmp_stride=4), torch.float16,
              "multiple of 16")]
    for overrides, dtype, message in cases:
        with pytest.raises(hf.SparseAttnUnsupportedError, match=message):
            hf.SparseAttnStaticCache(tiny_config(**overrides), max_batch_size=1, max_cache_len=64, device="cuda",
                                     dtype=dtype)


def test_the_transformers_cache_interface():
    model = tiny_model(seed=9)
    cache = static_cache(model, 2, 100)
    assert cache.is_compileable and cache.get_max_length() == 128 and len(cache.layers) == 2
    assert cache.get_mask_sizes(7, 0) == (7, 0)
    ids = torch.randint(1, 48, (2, 30))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    assert int(cache.get_seq_length()) == 30
    cache.crop(-6)
    assert int(cache.get_seq_length()) == 24 and cache.layers[0].compressed()[0].shape[1] == (24 - 8) // 4 + 1
    with torch.no_grad():  # after a crop, the rows of the blocks that complete again are pooled again
        logits = model(ids[:, 24:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(logits, model(ids, use_cache=False).logits[:, 24:], rtol=1e-9, atol=1e-9)
    cache.reset()
    assert int(cache.get_seq_length()) == 0 and cache.layers[1].host_length == 0
    with pytest.raises(hf.SparseAttnError, match="do not fit"):
        cache.update(torch.randn(3, 2, 1, 16, dtype=torch.float64), torch.randn(3, 2, 1, 16, dtype=torch.float64), 0)
    with pytest.raises(hf.SparseAttnError, match="float32"):
        cache.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), 0)
    with pytest.raises(hf.SparseAttnUnsupportedError, match="fixed"):
        cache.batch_repeat_interleave(2)
    with pytest.raises(hf.SparseAttnError, match="max_cache_len"):
        static_cache(model, 2, 0)
