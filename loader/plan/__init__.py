"""The plan of an epoch: the seeded order of samples, per rank, resumable."""
