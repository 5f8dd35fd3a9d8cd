"""Communicating less often: synchronous DiLoCo and asynchronous Local-SGD."""
