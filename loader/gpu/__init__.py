"""The GPU executor: workers read JPEG bytes, a prefetch thread decodes and augments on CUDA."""
