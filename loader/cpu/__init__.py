"""The CPU executor: workers decode, augment and collate each planned batch."""
