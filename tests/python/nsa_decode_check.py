"""Inputs and the reference of nsa_decode tests: random paged caches (shuffled pages, shared prefix pages, lengths
that differ within a batch) with their contiguous keys, and the definition of the result, nsa_attention over each
sequence's gathered keys (docs/semantics.md section 12)."""
import torch

import sparseattn


def rows(length, cfg):
    return 0 if length < cfg.cmp_block else (length - cfg.cmp_block) // cfg.cmp_stride + 1


def paged_case(lengths, Tq, Hq, Hkv, Dqk, Dv, page_size, cfg, dtype, generator, *, shared_prefix=0, spare_pages=3,
               max_cmp=None, device="cpu", scale=1.0):
    """A random batch: per sequence contiguous K/V (float64 copies on the CPU), the pages holding them under a
    shuffled block table (with `shared_prefix` > 0, every sequence shares the first shared_prefix // page_size pages
    of sequence 0 and their keys), the mean-pooled compressed rows [B, max_cmp, Hkv, D], q and gates."""
    B = len(lengths)
    opts = dict(dtype=torch.float64, generator=generator)
    max_pages = max(-(-L // page_size) for L in lengths) + 1
    shared_pages = shared_prefix // page_size
    own = [max(-(-L // page_size) - shared_pages, 0) for L in lengths]
    num_pages = shared_pages + sum(own) + spare_pages
    order = torch.randperm(num_pages, generator=generator).tolist()
    k_pages = torch.randn(num_pages, page_size, Hkv, Dqk, **opts) * scale
    v_pages = torch.randn(num_pages, page_size, Hkv, Dv, **opts)
    table = torch.zeros(B, max_pages, dtype=torch.int32)
    shared = order[:shared_pages]
    nxt = shared_pages
    for b in range(B):
        pages = shared + order[nxt: nxt + own[b]]
        nxt += own[b]
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        table[b, len(pages):] = torch.randint(0, num_pages, (max_pages - len(pages),), generator=generator)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    ks, vs = [], []
    for b, L in enumerate(lengths):
        pages = table[b, : -(-L // page_size)].long()
        ks.append(k_pages[pages].flatten(0, 1)[:L])
        vs.append(v_pages[pages].flatten(0, 1)[:L])
    max_cmp = max(max(rows(L, cfg) for L in lengths), 1) if max_cmp is None else max_cmp
    k_cmp = torch.randn(B, max_cmp, Hkv, Dqk, **opts)  # rows past rows(L) are never read
    v_cmp = torch.randn(B, max_cmp, Hkv, Dv, **opts)
    for b, L in enumerate(lengths):
        r = rows(L, cfg)
        if r:
            kc, vc = sparseattn.compress_kv(ks[b][None], vs[b][None], block=cfg.cmp_block, stride=cfg.cmp_stride)
            k_cmp[b, :r], v_cmp[b, :r] = kc[0], vc[0]
    q = torch.randn(B, Tq, Hq, Dqk, **opts) * scale
    gates = [torch.rand(B, Tq, Hq, **opts) for _ in range(3)]
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return dict(q=cast(q), k_pages=cast(k_pages), v_pages=cast(v_pages), block_table=table.to(device),
                cache_seqlens=seqlens.to(device), k_cmp=cast(k_cmp), v_cmp=cast(v_cmp),
                gates=[cast(g) for g in gates], ks=[cast(k) for k in ks], vs=[cast(v) for v in vs])


def chunk_reference(case, cfg, branches=(True, True, True), dtype=torch.float64, block_indices=None):
    """nsa_attention over each sequence's gathered keys and compressed rows on the CPU in `dtype`: the rows of the
    last Tq positions. block_indices (optional, [B, Tq, Hkv, n]) replaces the selection."""
    c = lambda t: t.detach().cpu().to(dtype)  # noqa: E731
    outs = []
    for b in range(case["q"].shape[0]):
        L = case["ks"][b].shape[0]
        r = rows(L, cfg)
        gates = [c(g[b: b + 1]) if on else None for g, on in zip(case["gates"], branches)]
        kw = {}
        if branches[0] or branches[1]:
            kw = dict(k_cmp=c(case["k_cmp"][b: b + 1, :r]), v_cmp=c(case["v_cmp"][b: b + 1, :r]))
        if block_indices is not None:
            kw["block_indices"] = block_indices[b: b + 1].cpu()
        outs.append(sparseattn.nsa_attention(c(case["q"][b: b + 1]), c(case["ks"][b][None]), c(case["vs"][b][None]),
                                             *gates, config=cfg, **kw))
    return torch.cat(outs)


def call(case, cfg, branches=(True, True, True), **kw):
    g = [t if on else None for t, on in zip(case["gates"], branches)]
    use_cmp = branches[0] or branches[1]
    return sparseattn.nsa_decode(case["q"], case["k_pages"], case["v_pages"], block_table=case["block_table"],
                                 cache_seqlens=case["cache_seqlens"], k_cmp=case["k_cmp"] if use_cmp else None,
                                 v_cmp=case["v_cmp"] if use_cmp else None, g_cmp=g[0], g_slc=g[1], g_swa=g[2],
                                 config=cfg, **kw)
