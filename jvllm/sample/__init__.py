"""On-device sampling: per-row sampling tensors, the sampler and log-probabilities."""
