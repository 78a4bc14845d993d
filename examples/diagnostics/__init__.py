"""The diagnostic suite (see README)."""
