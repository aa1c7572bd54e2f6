"""What tunes the GPU executor as it runs: the way picker and the CPU-share controller."""
