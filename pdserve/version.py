"""`__version__`: pdserve's version (`pdserve.__version__`, the HTTP API's /version)."""

__version__ = "0.1.0"
