"""One file per data source: real on-disk formats plus learnable built-in synthetic sets."""
