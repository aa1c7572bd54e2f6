"""The options that decide a build's content (same options, same records)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ingest.build.encoding import parse_encoding
from ingest.build.writer import MiB, initial_map_size
from ingest.format.codec import Compression
from ingest.format.layout import DEFAULT_MAX_PIXELS


@dataclass(frozen=True)
class BuildOptions:
    """What decides a store's content: the same options give the same records, and every
    field enters the build's fingerprint (a build resumes only under the same ones)."""

    shard_size: int = 512 * MiB
    compression: Compression = field(default_factory=Compression)
    max_size: int | None = None
    quality: int = 95
    verify: bool = True
    max_pixels: int = DEFAULT_MAX_PIXELS  # larger images are rejected (decompression bombs)
    max_file_bytes: int = 1 << 30  # larger source files are rejected, unread
    encoding: str = "jpeg"  # which samples are stored as pixels (``encoding.parse_encoding``)

    def __post_init__(self) -> None:  # one spelling of each encoding (or a clear error)
        object.__setattr__(self, "encoding", parse_encoding(self.encoding))

    def output_affecting(self) -> dict:
        d = asdict(self)
        d["compression"] = str(self.compression)
        if self.encoding == "jpeg":  # as before there were encodings: the same fingerprint
            del d["encoding"]
        return d


def default_map_size(options: BuildOptions) -> int:
    """A shard's initial LMDB map size for ``options`` (``writer.initial_map_size``)."""
    return initial_map_size(int(options.shard_size))
