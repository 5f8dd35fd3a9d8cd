"""The ``thinwire`` command line."""
