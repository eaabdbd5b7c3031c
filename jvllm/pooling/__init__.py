"""The embedding path: pooled forwards over padded batches, offline and for asyncio callers."""
