"""The tiny random-initialised NSA Llama of the transformers integration's CPU tests (float64): 2 layers, 4/2 heads,
compression 8 with stride 4, selection blocks of 8 (3 chosen, 1 local), a window of 12. Imported after the tests
have checked that transformers is there."""
import torch

from sparseattn import hf


def tiny_config(**overrides):
    fields = dict(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, nsa_cmp_block=8, nsa_cmp_stride=4, nsa_sel_block=8, nsa_num_selected=3,
                  nsa_num_local=1, nsa_window=12, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    fields.update(overrides)
    return hf.NSALlamaConfig(**fields)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return hf.NSALlamaForCausalLM(tiny_config(**overrides)).double().eval()


def recording_compile_config():
    """(transformers.CompileConfig, graphs): a compile config whose backend records each graph it is given and runs
    it as traced (fullgraph, on the CPU too), and the list the graphs go to: the CPU stand-in for transformers'
    compile path with CUDA graphs."""
    import transformers

    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    config = transformers.CompileConfig(backend=recording_backend, fullgraph=True, mode=None)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told otherwise
    return config, graphs


def greedy_reference(model, ids, new_tokens):
    """Greedy tokens of the full forward (no cache) re-run on the growing sequence: what generate() must give."""
    sequence = ids
    for _ in range(new_tokens):
        next_token = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
    return sequence
