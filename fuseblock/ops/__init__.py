"""Functional ops: argument checking, dispatch, autograd and custom-op registration."""
