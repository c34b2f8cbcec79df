"""TextEnv Chat's backend: model, engine, cache, tools, sessions (no UI imports)."""

from app.threads import one_thread_by_default

one_thread_by_default()  # before anything imports torch: only the scheduler's thread runs parallel kernels
