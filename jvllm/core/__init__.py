"""The request path's pure-Python core: requests, the scheduler, KV pages and the prefix cache (no JAX)."""
