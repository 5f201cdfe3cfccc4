"""The NSA pipeline on CUDA inside a CUDA graph and under torch.compile(fullgraph=True) (default Inductor backend).

CUDA graph: forward and backward of nsa_attention (NSA defaults, bf16) are captured together in one
torch.cuda.CUDAGraph and replayed on new values copied into the static inputs; every output and gradient equals
an eager run on the same values bit for bit (the kernels are deterministic). A capture fails on any host
synchronisation (e.g. reading cu_seqlens or a size back from the device), so this also shows that forward and
backward never synchronise. The packed case replays with a different split of the same tokens into sequences:
no size may be derived from the values of cu_seqlens on the host.

torch.compile: the functional call equals eager bit for bit (the custom ops are opaque to Inductor, and the only
other work, compressed_cu_seqlens, is integer arithmetic). The NativeSparseAttention layer is compared within
4 bf16 roundings of the largest value, because Inductor fuses the elementwise work around the projections
(sigmoid gates, float32 rotary embedding) and may round it differently from eager by an ulp.
"""
import pytest
import torch

from helpers import assert_close, cu_seqlens_of, require_sparseattn

sa = require_sparseattn()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not sa._C.built_with_cuda(),
                       reason="needs a CUDA GPU and a CUDA build of sparseattn"),
]

HQ, HKV, D = 16, 2, 128
BATCHED = (2, 1000)  # B, T
PACKED_SPLITS = ([1, 700, 1300], [1, 700, 1300], [1300, 1, 700])  # capture, replay, replay with another split
NAMES = ("o", "dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa")


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def random_inputs(layout, lengths=None):
    """[q, k, v, g_cmp, g_slc, g_swa, d_o] in bf16 on the GPU, batched or packed (N = sum(lengths))."""
    lead = BATCHED if layout == "batched" else (sum(lengths),)
    tensors = [torch.randn(*lead, heads, D, device="cuda") for heads in (HQ, HKV, HKV)]
    tensors += list(torch.sigmoid(torch.randn(3, *lead, HQ, device="cuda")).unbind(0))
    tensors.append(torch.randn(*lead, HQ, D, device="cuda"))
    return [x.to(torch.bfloat16) for x in tensors]


def forward_backward(fn, q, k, v, g_cmp, g_slc, g_swa, d_o, cu_seqlens):
    """fn(q, k, v, gates..., cu_seqlens) and its gradients w.r.t. q, k, v and the gates (no .grad side effects)."""
    o = fn(q, k, v, g_cmp, g_slc, g_swa, cu_seqlens)
    return (o, *torch.autograd.grad(o, (q, k, v, g_cmp, g_slc, g_swa), d_o))


def nsa(q, k, v, g_cmp, g_slc, g_swa, cu_seqlens):
    return sa.nsa_attention(q, k, v, g_cmp, g_slc, g_swa, cu_seqlens=cu_seqlens)


def eager(values, cu_seqlens):
    leaves = [x.clone().requires_grad_() for x in values[:6]]
    return forward_backward(nsa, *leaves, values[6], cu_seqlens)


@pytest.mark.parametrize("layout", ["batched", "packed"])
def test_cuda_graph_of_forward_and_backward_equals_eager(layout):
    splits = PACKED_SPLITS if layout == "packed" else (None,) * 3
    runs = [(random_inputs(layout, lengths), None if lengths is None else cu_seqlens_of(lengths, device="cuda"))
            for lengths in splits]
    static_values, static_cu = runs[0]
    static_values = [x.clone().requires_grad_(i < 6) for i, x in enumerate(static_values)]
    static_cu = None if static_cu is None else static_cu.clone()

    # Warm-up on a side stream, as torch.cuda.graph requires (allocator, lazy initialisation).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward_backward(nsa, *static_values, static_cu)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = forward_backward(nsa, *static_values, static_cu)

    for values, cu_seqlens in runs[1:]:
        with torch.no_grad():
            for static, value in zip(static_values, values):
                static.copy_(value)
            if static_cu is not None:
                static_cu.copy_(cu_seqlens)
        graph.replay()
        expected = eager(values, cu_seqlens)
        for name, got, want in zip(NAMES, static_outputs, expected):
            assert torch.equal(got, want), f"{name}: graph replay differs from eager ({layout}, cu_seqlens " \
                                           f"{None if cu_seqlens is None else cu_seqlens.tolist()})"


@pytest.mark.parametrize("layout", ["batched", "packed"])
def test_compiled_functional_equals_eager(layout):
    lengths = PACKED_SPLITS[0] if layout == "packed" else None
    values = random_inputs(layout, lengths)
    cu_seqlens = None if lengths is None else cu_seqlens_of(lengths, device="cuda")
    compiled = torch.compile(nsa, fullgraph=True)
    leaves = [x.clone().requires_grad_() for x in values[:6]]
    got = forward_backward(compiled, *leaves, values[6], cu_seqlens)
    for name, g, want in zip(NAMES, got, eager(values, cu_seqlens)):
        assert torch.equal(g, want), f"{name}: torch.compile result differs from eager ({layout})"


@pytest.mark.parametrize("layout", ["batched", "packed"])
def test_compiled_layer_matches_eager(layout):
    # 32 selected blocks of 64 tokens cover every block of these sequences (T <= 2048): selection is a
    # discontinuous function of q and k, and this keeps an ulp of difference in the rotary embedding from
    # choosing another block. The functional test above covers the default (competitive) selection.
    config = sa.NSAConfig(num_selected=32)
    layer = sa.NativeSparseAttention(hidden_size=512, num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                     config=config, device="cuda", dtype=torch.bfloat16)
    if layout == "packed":
        cu_seqlens = cu_seqlens_of(PACKED_SPLITS[0], device="cuda")
        x = torch.randn(sum(PACKED_SPLITS[0]), 512, device="cuda", dtype=torch.bfloat16)
    else:
        cu_seqlens = None
        x = torch.randn(*BATCHED, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    names, params = zip(*layer.named_parameters())

    def run(module):
        x_leaf = x.clone().requires_grad_()
        y = module(x_leaf, cu_seqlens=cu_seqlens)
        return (y, *torch.autograd.grad(y, (x_leaf, *params), dy))

    expected = run(layer)
    got = run(torch.compile(layer, fullgraph=True))
    for name, g, want in zip(("y", "dx", *(f"d {n}" for n in names)), got, expected):
        bf16_rounding = 2.0 ** -8 * want.abs().max().item()
        assert_close(g, want, atol=4 * bf16_rounding, name=f"{name} ({layout})")
