"""Paged KV cache: the page allocator (`PagePool`) and the per-layer KV storage (`KVCache`)."""
