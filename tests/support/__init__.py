"""Test support that is not a test: launchers of real processes (llama.cpp's server, the app itself) for the tests
and the benchmarks. Nothing under app/ imports it."""
