"""Everything that owns device memory for one engine: the paged KV pool and
its page allocator, the preallocated per-step buffers and the decode cache.
Nothing here knows the engine."""

from .block_tables import BlockTables, decode_slots
from .decode_cache import DecodeCache, DecodeCacheMismatch, DecodeRows, TaskSignature
from .inference_workspace import BUFFER_NAMES, InferenceWorkspace, WorkspaceShape
from .kv_pool import KVPool
from .page_allocator import PageAllocator, page_hash

__all__ = [
    "BUFFER_NAMES",
    "BlockTables",
    "DecodeCache",
    "DecodeCacheMismatch",
    "DecodeRows",
    "InferenceWorkspace",
    "KVPool",
    "PageAllocator",
    "TaskSignature",
    "WorkspaceShape",
    "decode_slots",
    "page_hash",
]
