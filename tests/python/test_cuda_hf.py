"""sparseattn.hf on CUDA: generate() of a small bf16 NSA Llama whose decode steps run nsa_decode's CUDA kernels over
the SparseAttnCache buffer seen as pages; every step's logits against the full forward's rows of the same sequence
(the prefill and the full forward run nsa_attention's CUDA kernels); left-padded batches of prompts of different
lengths against each sequence alone."""
import pytest
import torch

from helpers import require_sparseattn

require_sparseattn()
transformers = pytest.importorskip("transformers", reason="the transformers integration needs transformers")
import sparseattn  # noqa: E402
from sparseattn import hf  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not sparseattn._C.built_with_cuda(),
                       reason="needs a CUDA GPU and a CUDA build of sparseattn"),
]


def small_model(seed, heads, kv_heads, head_dim):
    torch.manual_seed(seed)
    config = hf.NSALlamaConfig(vocab_size=96, hidden_size=heads * head_dim, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               nsa_cmp_block=32, nsa_cmp_stride=16, nsa_sel_block=64, nsa_num_selected=4,
                               nsa_num_init=1, nsa_num_local=2, nsa_window=64, pad_token_id=0, eos_token_id=None,
                               bos_token_id=None)
    return hf.NSALlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


def assert_logits_close(got, expected, what, scale=None):
    """|got - expected| <= 0.05 max|scale| + 0.05, scale defaulting to expected: the bound of every comparison of
    two bf16 runs here (logits, or cached keys)."""
    scale = expected if scale is None else scale
    err = (got - expected).abs().max().item()
    assert err <= 0.05 * scale.abs().max().item() + 0.05, f"{what}: max error {err:.3g}"


def assert_steps_match_the_full_forward(model, out, prompt):
    """Every generate() step's logits (out.logits) against the full forward's rows of the generated sequence."""
    with torch.no_grad():
        full = model(out.sequences[:, :-1], use_cache=False).logits[:, prompt - 1:].float()
    steps = torch.stack(out.logits, dim=1).float()
    assert steps.shape == full.shape and torch.isfinite(steps).all()
    assert_logits_close(steps, full, "logits")


@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (16, 1)], ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_generate_decodes_through_nsa_decode_with_the_full_forwards_logits(monkeypatch, heads, head_dim):
    model = small_model(11, *heads, head_dim)
    batch, prompt, new_tokens = 2, 301, 40  # past compression, selection-block and window boundaries
    ids = torch.randint(1, 96, (batch, prompt), device="cuda")
    calls = []
    real = hf.nsa_decode

    def recording(q, k_pages, v_pages, **kwargs):
        calls.append(q.shape[1])
        return real(q, k_pages, v_pages, **kwargs)

    monkeypatch.setattr(hf, "nsa_decode", recording)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             past_key_values=hf.SparseAttnCache(), output_logits=True, return_dict_in_generate=True)
    assert len(calls) == (new_tokens - 1) * model.config.num_hidden_layers and set(calls) == {1}
    assert all(layer.self_attn.decode_unsupported is None for layer in model.model.layers)
    assert_steps_match_the_full_forward(model, out, prompt)


def test_generate_with_the_static_cache_runs_the_compiled_step_with_the_full_forwards_logits():
    """generate() with a SparseAttnStaticCache on CUDA takes transformers' compile path (mode "reduce-overhead":
    the decode step as a CUDA graph); every step's logits match the full forward's rows."""
    model = small_model(12, 8, 2, 128)
    batch, prompt, new_tokens = 2, 301, 40
    ids = torch.randint(1, 96, (batch, prompt), device="cuda")
    cache = hf.SparseAttnStaticCache(model.config, max_batch_size=batch, max_cache_len=prompt + new_tokens,
                                     device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             past_key_values=cache, output_logits=True, return_dict_in_generate=True)
    assert hasattr(model, "_compiled_call"), "generate() did not take transformers' compile path"
    assert int(cache.get_seq_length()) == prompt + new_tokens - 1
    assert all(layer.host_length == prompt + new_tokens - 1 for layer in cache.layers)
    assert_steps_match_the_full_forward(model, out, prompt)
    torch._dynamo.reset()


@pytest.mark.parametrize("heads", [(8, 2), (16, 1)], ids=lambda h: f"{h[0]}x{h[1]}")
def test_a_static_cache_decode_step_captures_in_a_cuda_graph_and_replays_every_step(heads):
    """One decode step (the whole model's forward) captured in a torch.cuda.CUDAGraph (a host synchronisation
    inside would make the capture fail), replayed with new token ids and positions: each replay's logits match the
    full forward's rows, and the cache's device lengths and compressed rows advance on the device."""
    model = small_model(13, *heads, 64)
    batch, prompt, new_tokens = 2, 250, 40  # past compression, selection-block and window boundaries
    ids = torch.randint(1, 96, (batch, prompt), device="cuda")
    cache = hf.SparseAttnStaticCache(model.config, max_batch_size=batch, max_cache_len=prompt + new_tokens,
                                     device="cuda", dtype=torch.bfloat16)
    token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    position = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        model(ids[:, :-1], past_key_values=cache, use_cache=True)
        token.copy_(ids[:, -1:])
        position.fill_(prompt - 1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up step (lazy initialisations), then undone
            model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True)
        torch.cuda.current_stream().wait_stream(side)
        cache.crop(-1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits
        cache.crop(0)  # the capture advanced the host-side lengths only: take the device's back
        sequence, steps = ids, []
        for step in range(new_tokens):
            graph.replay()
            steps.append(logits[:, -1].float().clone())
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], dim=1)
            token.copy_(next_token)
            position.fill_(prompt + step)
        assert cache.layers[0].lengths.tolist() == [prompt + new_tokens - 1] * batch
        full = model(sequence[:, :-1], use_cache=False).logits[:, prompt - 1:].float()
        length = prompt + new_tokens - 1
        for layer in cache.layers:
            keys = layer._keys[:, :length]
            k_cmp = sparseattn.compress_kv(keys, layer._values[:, :length], block=32, stride=16)[0]
            rows = k_cmp.shape[1]
            torch.testing.assert_close(layer._k_cmp[:, :rows].float(), k_cmp.float(), rtol=0.02, atol=0.02)
    steps = torch.stack(steps, dim=1)
    assert steps.shape == full.shape and torch.isfinite(steps).all()
    assert_logits_close(steps, full, "logits")


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device="cuda")
    mask = torch.zeros(len(prompts), width, dtype=torch.long, device="cuda")
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt):] = prompt
        mask[b, width - len(prompt):] = 1
    return ids, mask


@pytest.mark.parametrize("kind", ["sparseattn", "static", "dynamic"])
def test_a_left_padded_batch_generates_each_sequences_logits_alone(monkeypatch, kind):
    """Prompts of 77, 190 and 301 tokens, left-padded into one batch (bf16; the prefill as one varlen nsa_attention,
    the decode steps through nsa_decode's CUDA kernels with per-sequence lengths; with SparseAttnStaticCache the
    compiled CUDA-graph steps; with transformers' DynamicCache, varlen nsa_attention over the padded layout's real
    keys at every step): every step's logits of each sequence match the full forward of that sequence alone,
    and the tokens match the sequence generated alone wherever the two runs' top logits are not near a tie."""
    model = small_model(14, 8, 2, 128)
    lengths, new_tokens = (77, 190, 301), 40  # past compression, selection-block and window boundaries
    prompts = [torch.randint(1, 96, (n,), device="cuda") for n in lengths]
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    decoded = []
    real = hf.nsa_decode

    def recording(q, k_pages, v_pages, **kwargs):
        decoded.append(kwargs["cache_seqlens"])
        return real(q, k_pages, v_pages, **kwargs)

    if kind == "sparseattn":  # (the static cache's steps are compiled: no Python wrapper inside them)
        monkeypatch.setattr(hf, "nsa_decode", recording)

    def cache(batch):
        if kind == "sparseattn":
            return {"past_key_values": hf.SparseAttnCache()}
        if kind == "dynamic":
            return {}  # generate() makes a DynamicCache
        return {"past_key_values": hf.SparseAttnStaticCache(model.config, max_batch_size=batch,
                                                            max_cache_len=width + new_tokens, device="cuda",
                                                            dtype=torch.bfloat16)}

    torch._dynamo.reset()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **cache(3))
    if kind == "static":
        assert hasattr(model, "_compiled_call"), "generate() did not take transformers' compile path"
    elif kind == "sparseattn":
        assert len(decoded) == (new_tokens - 1) * model.config.num_hidden_layers
        assert decoded[-1].tolist() == [n + new_tokens - 1 for n in lengths]
    steps = torch.stack(out.logits, dim=1).float()  # [3, new_tokens, vocab]
    assert torch.isfinite(steps).all()
    for b, prompt in enumerate(prompts):
        sequence = torch.cat([prompt, out.sequences[b, width:]])[None]
        with torch.no_grad():
            full = model(sequence[:, :-1], use_cache=False).logits[0, len(prompt) - 1:].float()
        assert_logits_close(steps[b], full, f"sequence {b}: logits")
        with torch.no_grad():
            alone = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                                         device="cuda"),
                                   max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True, **cache(1))
        alone_steps = torch.stack(alone.logits, dim=1)[0].float()
        differs = (alone.sequences[0, len(prompt):] != out.sequences[b, width:]).nonzero()
        if len(differs):  # bf16 rounding may flip a near tie; up to there the runs must agree
            first = int(differs[0])
            top2 = alone_steps[first].topk(2).values
            assert (top2[0] - top2[1]).item() <= 0.1 * full.abs().max().item() + 0.1, (
                f"sequence {b} leaves the tokens generated alone at step {first} without a near tie")
        else:
            assert_logits_close(steps[b], alone_steps, f"sequence {b}: logits against the run alone", scale=full)
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["sparseattn", "static"])
def test_a_chunked_prefill_of_a_left_padded_batch(kind):
    """A padded batch's prefill in chunks of 64 columns (bf16): the first chunks hold no real token of the shorter
    sequences (varlen calls with empty sequences); each sequence's real rows match its full forward alone and the
    cache holds its keys from slot 0."""
    model = small_model(15, 8, 2, 64)
    lengths = (77, 190, 301)
    prompts = [torch.randint(1, 96, (n,), device="cuda") for n in lengths]
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    if kind == "sparseattn":
        cache = hf.SparseAttnCache()
    else:
        cache = hf.SparseAttnStaticCache(model.config, max_batch_size=3, max_cache_len=width, device="cuda",
                                         dtype=torch.bfloat16)
    with torch.no_grad():
        logits = torch.cat([model(ids[:, a:a + 64], attention_mask=mask[:, :a + 64], past_key_values=cache,
                                  use_cache=True).logits for a in range(0, width, 64)], dim=1).float()
    assert torch.isfinite(logits[mask == 1]).all()
    for b, prompt in enumerate(prompts):
        alone_cache = hf.SparseAttnCache()
        with torch.no_grad():
            alone = model(prompt[None], past_key_values=alone_cache, use_cache=True).logits[0].float()
        assert_logits_close(logits[b, width - len(prompt):], alone, f"sequence {b}: logits")
        for layer, alone_layer in zip(cache.layers, alone_cache.layers):
            keys, expected = layer._keys[b, :len(prompt)].float(), alone_layer._keys[0, :len(prompt)].float()
            assert_logits_close(keys, expected, f"sequence {b}: cached keys")
