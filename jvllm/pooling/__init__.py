"""The pooled path: embeddings and text-pair scores over padded batches, offline and for asyncio callers."""
