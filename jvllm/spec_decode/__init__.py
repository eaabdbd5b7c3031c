"""Speculative decoding: proposers of draft tokens (n-gram prompt lookup, suffix matching), the policy that decides
when to speculate, and the acceptance counters."""
