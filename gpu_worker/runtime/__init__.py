"""The worker process at run time: its loop, batch state, sampling, KV pool and tensor-parallel group."""
