"""The /dev/shm shard cache: one RAM copy of each shard, shared by every reader."""
