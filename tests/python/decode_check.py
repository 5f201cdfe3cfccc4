"""Helpers of the flash_decode tests (test_decode.py on the CPU, test_cuda_decode.py on the GPU): paged copies of a
dense cache, each sequence's gathered keys, and the causal/window rule as a boolean [Tq, L] matrix."""
import torch


def page_table(B, S, page_size, generator, spare=3):
    """A shuffled block table int32 [B, ceil(S / page_size)] over B * max_pages + spare pages, and the page count."""
    max_pages = -(-S // page_size)
    num_pages = B * max_pages + spare
    order = torch.randperm(num_pages, generator=generator)[:B * max_pages].reshape(B, max_pages)
    return order.to(torch.int32), num_pages


def to_pages(dense, table, num_pages, page_size, generator):
    """The dense cache [B, S, H, D] as pages [num_pages, page_size, H, D] laid out by `table` (on dense's device;
    the rows no key maps to are random)."""
    pages = torch.randn(num_pages, page_size, *dense.shape[2:], dtype=torch.float64, generator=generator)
    pages = pages.to(device=dense.device, dtype=dense.dtype)
    for b in range(dense.shape[0]):
        for j in range(table.shape[1]):
            rows = dense[b, j * page_size:(j + 1) * page_size]
            pages[int(table[b, j]), :rows.shape[0]] = rows
    return pages


def gathered(cache, block_table, b, length):
    """Keys [0, length) of sequence b as [length, H, D]: dense rows, or rows of the block table's pages."""
    if block_table is None:
        return cache[b, :length]
    page_size = cache.shape[1]
    s = torch.arange(length)
    pages = block_table[b].cpu().long()[s // page_size]
    return cache[pages.to(cache.device), (s % page_size).to(cache.device)]


