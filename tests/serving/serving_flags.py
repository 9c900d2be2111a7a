"""Server flags shared by the serving tests (a module of its own: several folders have a conftest)."""

TINY_FLAGS = ("--kv-cache-memory", "16MiB", "--threads", "1")
