"""The on-disk contract of a store, shared by the converter and the loader (docs/FORMAT.md).

One module per part: ``layout`` (names, constants, keys, index row), ``manifest`` (read
and checked first; ``store_file`` resolves every file), ``index`` (the index, the rejects,
the pixel limit), ``codec`` (records), ``pages`` (a shard's LMDB pages), ``errors``,
``text`` (paths in messages), ``atomic`` (crash-safe writes), ``safeio`` (hostile reads),
``lock`` (a build's hold on OUT), ``cachedir`` (the node's shard cache), ``checksum``
(the records' CRC-32). The names other code uses as ``fmt.X`` are re-exported here.
"""

from __future__ import annotations

from ingest.format.atomic import fsync_path, write_json_atomic
from ingest.format.codec import check_record
from ingest.format.errors import (
    AccessDenied,
    PixelLimitError,
    RecordError,
    StoreError,
    access_denied,
)
from ingest.format.index import index_problem, load_index, pixel_limit, read_rejects
from ingest.format.layout import (
    BUILD_KEY,
    BUILD_STATE,
    CONVERTER_VERSION,
    DEFAULT_MAX_PIXELS,
    FLAG_COMPRESSED,
    FLAG_PROGRESSIVE,
    FLAG_REENCODED,
    FORMAT_CODES,
    FORMAT_NAME,
    FORMAT_NAMES,
    FORMAT_VERSION,
    INDEX,
    INDEX_DTYPE,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    PARTIAL_DIR,
    PATHS,
    READABLE_VERSIONS,
    REJECTS,
    RETIRED_DIR,
    STAGING_DIR,
    SUBSAMPLING_CODES,
    SUBSAMPLING_NAMES,
    decode_key,
    encode_key,
    own_entries,
    records_digest,
    remove_entry,
    shard_name,
    shard_records,
    written_version,
)
from ingest.format.manifest import read_manifest, store_file
from ingest.format.text import json_line, path_text, path_value, shown

__all__ = [
    "BUILD_KEY",
    "BUILD_STATE",
    "CONVERTER_VERSION",
    "DEFAULT_MAX_PIXELS",
    "FLAG_COMPRESSED",
    "FLAG_PROGRESSIVE",
    "FLAG_REENCODED",
    "FORMAT_CODES",
    "FORMAT_NAME",
    "FORMAT_NAMES",
    "FORMAT_VERSION",
    "INDEX",
    "INDEX_DTYPE",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "PARTIAL_DIR",
    "PATHS",
    "READABLE_VERSIONS",
    "REJECTS",
    "RETIRED_DIR",
    "STAGING_DIR",
    "SUBSAMPLING_CODES",
    "SUBSAMPLING_NAMES",
    "AccessDenied",
    "PixelLimitError",
    "RecordError",
    "StoreError",
    "access_denied",
    "check_record",
    "decode_key",
    "encode_key",
    "fsync_path",
    "index_problem",
    "json_line",
    "load_index",
    "own_entries",
    "path_text",
    "path_value",
    "pixel_limit",
    "read_manifest",
    "read_rejects",
    "records_digest",
    "remove_entry",
    "shard_name",
    "shard_records",
    "shown",
    "store_file",
    "write_json_atomic",
    "written_version",
]
