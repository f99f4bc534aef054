"""Benchmarks that compare frugality with reference implementations in the same process."""
