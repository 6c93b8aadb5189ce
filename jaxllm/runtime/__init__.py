"""Host-side runtime: requests, KV block accounting and scheduling.

Pure Python + numpy by design (a test checks that importing it never imports
jax): everything here decides *what* runs in a step and emits plain data; the
device side only executes it.
"""
