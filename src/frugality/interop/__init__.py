"""Conversions between frugality's models and other frameworks' checkpoints."""
