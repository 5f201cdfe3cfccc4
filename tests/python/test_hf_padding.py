"""sparseattn.hf with left-padded batches (prompts of different lengths) on the CPU (float64, tiny random models):
each sequence's tokens and logits equal those of the sequence run alone, with SparseAttnCache, SparseAttnStaticCache
(eager and through transformers' compile path) and transformers' DynamicCache; the caches keep each sequence's real
keys from slot 0; right padding and holes are refused (docs/semantics.md section 13)."""
import pytest
import torch

from helpers import require_sparseattn

require_sparseattn()
transformers = pytest.importorskip("transformers", reason="the transformers integration needs transformers")
import sparseattn  # noqa: E402
from sparseattn import hf  # noqa: E402
from hf_models import recording_compile_config, tiny_model  # noqa: E402

# Prompt lengths crossing the compression (8, stride 4), selection (8) and window (12) blocks of tiny_config.
LENGTHS = (5, 19, 30)


def left_padded(prompts, pad=0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt):] = prompt
        mask[b, width - len(prompt):] = 1
    return ids, mask


def make_cache(kind, model, batch, length):
    if kind == "sparseattn":
        return {"past_key_values": hf.SparseAttnCache()}
    if kind == "static":
        return {"past_key_values": hf.SparseAttnStaticCache(model.config, max_batch_size=batch, max_cache_len=length,
                                                            device="cpu", dtype=torch.float64)}
    if kind == "dynamic-explicit":
        return {"past_key_values": transformers.DynamicCache()}
    return {}  # generate() makes a DynamicCache


def generate(model, ids, mask, new_tokens, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("lengths", [LENGTHS, (3, 9, 14)], ids=["long", "short"])  # short: a prefill of <= 16
@pytest.mark.parametrize("kind", ["sparseattn", "static", "dynamic"])
def test_a_padded_batch_generates_what_each_sequence_generates_alone(kind, lengths):
    model = tiny_model(seed=3)
    prompts = [torch.randint(1, 48, (n,)) for n in lengths]
    ids, mask = left_padded(prompts)
    width, new_tokens = ids.shape[1], 21
    out = generate(model, ids, mask, new_tokens, **make_cache(kind, model, 3, width + new_tokens))
    for b, prompt in enumerate(prompts):
        alone = generate(model, prompt[None], torch.ones(1, len(prompt), dtype=torch.long), new_tokens,
                         **make_cache(kind, model, 1, width + new_tokens))
        assert torch.equal(out.sequences[b, width:], alone.sequences[0, len(prompt):]), f"sequence {b}"
        for step, (padded_logits, alone_logits) in enumerate(zip(out.logits, alone.logits)):
            torch.testing.assert_close(padded_logits[b], alone_logits[0], rtol=1e-9, atol=1e-9,
                                       msg=lambda m: f"sequence {b}, step {step}: {m}")
    # The padding matters: read as tokens, it changes the shorter sequences' logits.
    unmasked = generate(model, ids, torch.ones_like(mask), 1, **make_cache(kind, model, 3, width + 1))
    assert not torch.allclose(unmasked.logits[0][0], out.logits[0][0])


def test_padded_decode_steps_run_nsa_decode_with_per_sequence_lengths(monkeypatch):
    model = tiny_model(seed=6)
    prompts = [torch.randint(1, 48, (n,)) for n in LENGTHS]
    ids, mask = left_padded(prompts)
    calls = []
    real = hf.nsa_decode

    def recording(q, k_pages, v_pages, **kwargs):
        calls.append((q.shape[1], kwargs["cache_seqlens"].tolist(), kwargs["k_cmp"].shape[1]))
        return real(q, k_pages, v_pages, **kwargs)

    monkeypatch.setattr(hf, "nsa_decode", recording)
    cache = hf.SparseAttnCache()
    out = generate(model, ids, mask, 9, past_key_values=cache)
    layers = model.config.num_hidden_layers
    assert len(calls) == 8 * layers and all(tq == 1 for tq, _, _ in calls)
    assert [lengths for _, lengths, _ in calls[::layers]] == [[n + 1 + s for n in LENGTHS] for s in range(8)]
    assert all(layer.self_attn.decode_unsupported is None for layer in model.model.layers)
    assert cache.get_seq_length() == ids.shape[1] + 8  # the padded width, as transformers counts it
    for layer in cache.layers:
        assert layer.seq_lengths == [n + 8 for n in LENGTHS]
    for b, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=9, do_sample=False)
        assert torch.equal(out.sequences[b, ids.shape[1]:], alone[0, len(prompt):])


@pytest.mark.parametrize("kind", ["sparseattn", "static"])
def test_a_chunked_padded_prefill_keeps_each_sequences_real_keys_from_slot_0(kind):
    """Chunks of 10 columns (a sequence has no real token in the first chunks): the real rows' logits equal the
    sequence's forward alone, and each layer holds the sequence's keys from slot 0 with their compressed rows."""
    model = tiny_model(seed=4)
    prompts = [torch.randint(1, 48, (n,)) for n in LENGTHS]
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    cache = make_cache(kind, model, 3, 64)["past_key_values"]
    with torch.no_grad():
        logits = torch.cat([model(ids[:, a:a + 10], attention_mask=mask[:, :a + 10], past_key_values=cache,
                                  use_cache=True).logits for a in range(0, width, 10)], dim=1)
    for b, prompt in enumerate(prompts):
        alone_cache = hf.SparseAttnCache()
        with torch.no_grad():
            alone = model(prompt[None], past_key_values=alone_cache, use_cache=True).logits
        torch.testing.assert_close(logits[b, width - len(prompt):], alone[0], rtol=1e-9, atol=1e-9)
        for layer, alone_layer in zip(cache.layers, alone_cache.layers):
            keys = layer._keys[b, :len(prompt)]
            torch.testing.assert_close(keys, alone_layer._keys[0, :len(prompt)], rtol=1e-12, atol=1e-12)
            k_cmp, _ = sparseattn.compress_kv(keys[None], layer._values[b:b + 1, :len(prompt)], block=8, stride=4)
            torch.testing.assert_close(layer._k_cmp[b, :k_cmp.shape[1]], k_cmp[0], rtol=1e-12, atol=1e-12)
    assert int(cache.get_seq_length()) == width


def test_a_padded_forward_without_a_cache_and_training():
    """No cache: the real rows equal each sequence alone, the attention rows of the padding are 0, the pad tokens'
    ids change nothing else, and gradients flow (training on a padded batch)."""
    model = tiny_model(seed=5).train()
    prompts = [torch.randint(1, 48, (n,)) for n in LENGTHS]
    ids, mask = left_padded(prompts)
    attention_rows = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda m, i, o: attention_rows.append(o[0]))
    logits = model(ids, attention_mask=mask, use_cache=False).logits
    other_pads = model(left_padded(prompts, pad=7)[0], attention_mask=mask, use_cache=False).logits
    hook.remove()
    assert torch.equal(attention_rows[0][mask == 0], torch.zeros_like(attention_rows[0][mask == 0]))
    for b, prompt in enumerate(prompts):
        alone = model(prompt[None], use_cache=False).logits[0]
        torch.testing.assert_close(logits[b, mask[b] == 1], alone, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(other_pads[b, mask[b] == 1], alone, rtol=1e-9, atol=1e-9)
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_a_padded_batch_through_the_compiled_static_step():
    """transformers' compile path on the CPU (a recording backend): the padded prefill runs eagerly, one graph
    without breaks serves every decode step, and each sequence's tokens equal the sequence's alone."""
    model = tiny_model(seed=8)
    compile_config, graphs = recording_compile_config()
    prompts = [torch.randint(1, 48, (n,)) for n in LENGTHS]
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    cache = hf.SparseAttnStaticCache(model.config, max_batch_size=3, max_cache_len=width + 12, device="cpu",
                                     dtype=torch.float64)
    torch._dynamo.reset()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, past_key_values=cache,
                         compile_config=compile_config)
    torch._dynamo.reset()
    assert len(graphs) == 1
    assert cache.layers[0].lengths.tolist() == [n + 11 for n in LENGTHS] and cache.layers[0].host_length == 41
    assert int(cache.get_seq_length()) == width + 11
    for b, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=12, do_sample=False)
        assert torch.equal(out[b, width:], alone[0, len(prompt):])


@pytest.mark.parametrize("kind", ["none", "sparseattn", "static"])
def test_right_padding_and_holes_are_refused(kind):
    model = tiny_model()
    ids = torch.randint(1, 48, (2, 6))
    cases = [([[1, 1, 1, 1, 0, 0], [1] * 6], "sequence 0 has right padding"),
             ([[1] * 6, [0, 1, 1, 0, 1, 1]], "sequence 1 has a hole"),
             ([[1] * 6, [0, 0, 1, 1, 1, 0]], "sequence 1 has right padding")]
    for rows, message in cases:
        mask = torch.tensor(rows)
        pattern = rf"sparseattn\.NSALlamaForCausalLM: argument 'attention_mask': {message}"
        with pytest.raises(hf.SparseAttnUnsupportedError, match=pattern):
            model(ids, attention_mask=mask)
        with pytest.raises(hf.SparseAttnUnsupportedError, match=pattern):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                           **({} if kind == "none" else make_cache(kind, model, 2, 10)))


def test_a_mask_that_does_not_match_the_cache_is_refused():
    model = tiny_model()
    ids = torch.randint(1, 48, (2, 6))
    with torch.no_grad():
        for kind in ("sparseattn", "static"):
            cache = make_cache(kind, model, 2, 20)["past_key_values"]
            model(ids, past_key_values=cache, use_cache=True)  # 6 real tokens each
            with pytest.raises(hf.SparseAttnError, match="the cache holds"):
                model(ids[:, :2], attention_mask=torch.tensor([[0] * 7 + [1], [1] * 8]), past_key_values=cache,
                      use_cache=True)
        cache = hf.SparseAttnCache()
        model(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]), past_key_values=cache, use_cache=True)
        with pytest.raises(hf.SparseAttnUnsupportedError, match="every call needs its attention mask"):
            model(ids[:, :1], past_key_values=cache, use_cache=True)


def test_the_worked_example_of_the_semantics(monkeypatch):
    """docs/semantics.md section 13: l = 4, d = 2, prompts of 3 and 6 tokens."""
    model = tiny_model(seed=10, nsa_cmp_block=4, nsa_cmp_stride=2, nsa_sel_block=4, nsa_num_selected=2,
                       nsa_num_local=1, nsa_window=4)
    prompts = [torch.randint(1, 48, (3,)), torch.randint(1, 48, (6,))]
    ids, mask = left_padded(prompts)
    assert hf._padded_positions(mask, 6).tolist() == [[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    padding = hf._left_padding(mask, 6)
    assert padding.queries()[2].tolist() == [0, 3, 9]
    cache = hf.SparseAttnCache()
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    assert layer.seq_lengths == [3, 6] and cache.get_seq_length() == 6 and layer.cmp_rows == 2
    lengths = []
    real = hf.nsa_decode

    def recording(*args, **kwargs):
        lengths.append(kwargs["cache_seqlens"].tolist())
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "nsa_decode", recording)
    with torch.no_grad():
        model(torch.tensor([[5], [6]]), attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
              past_key_values=cache, use_cache=True)
    assert lengths[0] == [4, 7]
    k_cmp, _ = sparseattn.compress_kv(layer._keys[:1, :4], layer._values[:1, :4], block=4, stride=2)
    torch.testing.assert_close(layer._k_cmp[0, :1], k_cmp[0], rtol=0, atol=0)  # a's row 0: tokens 0..3


def test_beam_search_over_a_padded_batch():
    """num_beams = 2: transformers reorders the SparseAttnCache's sequences at every step (their buffers, rows and
    lengths follow); each sequence's beams equal its beams alone with transformers' DynamicCache."""
    model = tiny_model(seed=11)
    prompts = [torch.randint(1, 48, (n,)) for n in LENGTHS]
    ids, mask = left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, num_beams=2,
                         past_key_values=hf.SparseAttnCache())
    for b, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=8, do_sample=False, num_beams=2)
        assert torch.equal(out[b, ids.shape[1]:], alone[0, len(prompt):]), f"sequence {b}"


@pytest.mark.parametrize("kind", ["sparseattn", "static", "dynamic"])
def test_generates_chunked_prefill_of_a_padded_batch(kind):
    """generate(prefill_chunk_size=8): the first chunks hold only padding for the shorter sequences."""
    model = tiny_model(seed=12)
    prompts = [torch.randint(1, 48, (n,)) for n in LENGTHS]
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    out = generate(model, ids, mask, 6, prefill_chunk_size=8,
                   **make_cache(kind if kind != "dynamic" else "dynamic-explicit", model, 3, width + 6))
    for b, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=6, do_sample=False)
        assert torch.equal(out.sequences[b, width:], alone[0, len(prompt):]), f"sequence {b}"


@pytest.mark.parametrize("kind", ["sparseattn", "static"])
def test_crop_counts_columns_of_the_padded_width(kind):
    """crop(-6) after a padded prefill of 30 columns keeps 24: sequence b keeps its real tokens among them (5, 19
    and 30 real tokens: 0, 13 and 24 kept); running the last 6 columns again gives the same rows."""
    model = tiny_model(seed=13)
    prompts = [torch.randint(1, 48, (n,)) for n in LENGTHS]
    ids, mask = left_padded(prompts)
    cache = make_cache(kind, model, 3, 40)["past_key_values"]
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        cache.crop(-6)
        assert int(cache.get_seq_length()) == 24
        lengths = cache.layers[0].seq_lengths if kind == "sparseattn" else cache.layers[0].lengths.tolist()
        assert lengths == [0, 13, 24]
        again = model(ids[:, 24:], attention_mask=mask, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(again[mask[:, 24:] == 1], logits[:, 24:][mask[:, 24:] == 1], rtol=1e-9, atol=1e-9)
