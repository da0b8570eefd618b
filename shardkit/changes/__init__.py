"""Changing a finished output without packing it again: `remove` takes records out (a takedown),
through `journal`'s one-writer, kill-safe commit."""
