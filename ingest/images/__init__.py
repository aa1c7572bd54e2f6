"""Image checks and normalisation: header probes, JPEG/PNG checks, re-encoding."""
