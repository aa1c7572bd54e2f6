"""The peer formats of imfeed-bench (FFCV, MosaicML Streaming, LitData, WebDataset): each
converts the run's image folder once with its own writer, then reads it with its own loader.
"""
