"""The paged KV pool: one K and one V tensor per layer, split into fixed-size
pages, allocated once at start-up and only indexed afterwards."""

from __future__ import annotations

import math
import mmap

import torch


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of `shape` whose memory is touched only as it is written.

    On the CPU it lives in a private anonymous mapping: the OS hands out zero
    pages on first touch, so a large pool costs address space, not resident
    memory, until its pages are used, and reads of never-written slots see
    zeros. Elsewhere (CUDA, or a platform whose `mmap` takes no flags) it is
    `torch.zeros`.
    """
    device = torch.device(device)
    if device.type != "cpu" or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor holds a reference to the mapping, which is unmapped when the tensor is freed.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # fd -1: anonymous
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


class KVPool:
    """K/V storage of shape `[num_layers, num_pages, page_size, num_kv_heads, head_dim]`.

    A token's *slot* is `page * page_size + offset`; writes scatter by slot,
    reads gather whole pages by a block table. Pages start zeroed so padded
    reads past a sequence's end are finite (they are masked, and a masked
    NaN would still poison the weighted sum of values). On the CPU the zeros
    come from the OS on first touch (`zero_pages`), so resident memory grows
    with the pages written rather than with the pool's size.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        routing: tuple[int, int, torch.dtype] | None = None,
    ) -> None:
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = zero_pages(shape, dtype, device)
        self.v = zero_pages(shape, dtype, device)
        # Mixture-of-experts models: `routing` = (sparse layers, experts per token, dtype) gives
        # `[sparse layers, num_pages, page_size, top_k]` expert ids, written with each token's KV,
        # so a page carries the routing of the computation its keys and values came from.
        self.routing = (
            None if routing is None else zero_pages((routing[0], num_pages, page_size, routing[1]), routing[2], device)
        )
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (0 if self.routing is None else self.routing.nbytes)

    def write_routing(self, layer: int, slots: torch.Tensor, experts: torch.Tensor) -> None:
        """Store sparse layer `layer`'s experts `[T, top_k]` of the tokens at `slots` `[T]`."""
        flat = self.routing[layer].view(-1, self.routing.shape[-1])
        flat.index_copy_(0, slots, experts.to(self.routing.dtype))

    def read_routing(self, slots: torch.Tensor) -> torch.Tensor:
        """The experts stored at `slots` `[N]`, as `[N, sparse layers, top_k]`."""
        flat = self.routing.view(self.routing.shape[0], -1, self.routing.shape[-1])
        return flat.index_select(1, slots).transpose(0, 1)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k`, `v` of shape `[T, num_kv_heads, head_dim]` at `slots` `[T]`, cast to the pool's
        dtype (rounded to nearest even, as the compiled kernels store them)."""
        flat = (-1, self.num_kv_heads, self.head_dim)
        self.k[layer].view(flat).index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].view(flat).index_copy_(0, slots, v.to(self.v.dtype))

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the pages in `block_table` (`[..., P]`), as `[..., P * page_size, H, D]`."""
        # index_select copies whole pages; advanced indexing (k[layer][table])
        # goes element by element, which costs several times as much.
        shape = (*block_table.shape[:-1], -1, self.num_kv_heads, self.head_dim)
        flat = block_table.reshape(-1)
        return self.k[layer].index_select(0, flat).view(shape), self.v[layer].index_select(0, flat).view(shape)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages `src[i] -> dst[i]` in every layer (copy-on-write)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        if self.routing is not None:
            self.routing[:, dst] = self.routing[:, src]
